"""route_dropout(fuse_residual=True, fuse_matmul=True) on torchax tensors: inside a JAX trace
the add of a routed dropout is dropout_add, and its product with a value dropout_matmul (the
attention kernel, when the weights are the softmax of q @ k.T), with the dropout's key; the
traced step holds one kernel."""

import jax
import jax.extend.core
from jax._src.interpreters import partial_eval
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torchax.interop import jax_view, torch_view

import torch_pallas
from torch_pallas import residual_fusion
from torchax_support import ENV, SHAPE, in_env, jax_tensor, numpy  # noqa: F401  (in_env: fixture)

def step(fuse_residual):
    def residual_block(x, residual, key):
        with ENV, torch_pallas.seeds.key_scope(torch_view(key)), \
                torch_pallas.route_dropout(fuse_residual=fuse_residual):
            return jax_view(torch_view(residual) + F.dropout(torch_view(x), 0.5))
    return jax.jit(residual_block)


def kernels(jitted, *args, dead_code_removed: bool) -> int:
    """Pallas kernels in the traced step, before or after JAX drops what no output reads (as
    jit does when it lowers)."""
    jaxpr = jax.make_jaxpr(jitted)(*args).jaxpr
    if dead_code_removed:
        jaxpr, _ = partial_eval.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
    return str(jaxpr).count("pallas_call")


@pytest.mark.usefixtures("in_env")
def test_traced_residual_dropout_is_one_kernel_with_the_unfused_mask():
    rng = np.random.default_rng(0)
    x, residual = (jax_view(jax_tensor(rng.integers(-8, 8, SHAPE).astype(np.float32))) for _ in range(2))
    key = jax_view(torch_pallas.seeds.key_data(seed=3))
    fused, unfused = step(True), step(False)
    np.testing.assert_array_equal(np.asarray(fused(x, residual, key)), np.asarray(unfused(x, residual, key)))
    # Fused: the dropout's kernel is traced, then dropped, dead; dropout_add's is the one left.
    assert kernels(fused, x, residual, key, dead_code_removed=False) == 2
    assert kernels(fused, x, residual, key, dead_code_removed=True) == 1
    assert kernels(unfused, x, residual, key, dead_code_removed=True) == 1  # and XLA's add after it
    eager = torch_pallas.route_dropout(fuse_residual=True)
    with eager:  # eager torchax: the dropout kernel has run already, nothing is fused
        y = F.dropout(torch_view(x), 0.5)
    assert not hasattr(y, "_torch_pallas_drawn_dropout")


def attention_product(fuse_matmul):
    def product(weights, value, key):
        # threefry: the fused kernels' mask is then the unfused dropout's
        with ENV, torch_pallas.seeds.key_scope(torch_view(key)), \
                torch_pallas.route_dropout(impl="threefry", fuse_matmul=fuse_matmul):
            return jax_view(F.dropout(torch_view(weights), 0.5) @ torch_view(value))
    return jax.jit(product)


@pytest.mark.usefixtures("in_env")
def test_traced_attention_dropout_and_its_product_are_one_kernel_with_the_unfused_values_and_gradients():
    rng = np.random.default_rng(1)
    weights = jax_view(jax_tensor(rng.integers(-8, 8, (2, 16, 256)).astype(np.float32)))
    value = jax_view(jax_tensor(rng.integers(-8, 8, (2, 256, 8)).astype(np.float32)))
    key = jax_view(torch_pallas.seeds.key_data(seed=4))
    fused, unfused = attention_product(True), attention_product(False)
    for f, u in zip(jax.vjp(fused, weights, value, key)[:1] + (jax.grad(lambda w, v: fused(w, v, key).sum(),
                                                                        argnums=(0, 1))(weights, value)),
                    jax.vjp(unfused, weights, value, key)[:1] + (jax.grad(lambda w, v: unfused(w, v, key).sum(),
                                                                          argnums=(0, 1))(weights, value))):
        np.testing.assert_array_equal(np.asarray(f), np.asarray(u))  # integers: every sum exact
    assert kernels(fused, weights, value, key, dead_code_removed=True) == 1


@pytest.mark.usefixtures("in_env")
@pytest.mark.parametrize("scores_shape, Ev", [((2, 16, 256), 8), ((2, 4, 16, 128), 32)],
                         ids=["planes", "heads-in-lanes"])
def test_traced_softmax_dropout_and_product_are_one_kernel_close_to_unfused(scores_shape, Ev):
    def attention_weights_product(fuse_matmul):
        def product(scores, value, key):
            with ENV, torch_pallas.seeds.key_scope(torch_view(key)), \
                    torch_pallas.route_dropout(impl="threefry", fuse_matmul=fuse_matmul):
                return jax_view(F.dropout(torch.softmax(torch_view(scores), -1), 0.5) @ torch_view(value))
        return jax.jit(product)

    rng = np.random.default_rng(2)
    scores = jax_view(jax_tensor(rng.standard_normal(scores_shape).astype(np.float32)))
    value = jax_view(jax_tensor(rng.standard_normal((*scores_shape[:-2], scores_shape[-1], Ev)).astype(np.float32)))
    key = jax_view(torch_pallas.seeds.key_data(seed=5))
    fused, unfused = attention_weights_product(True), attention_weights_product(False)
    for f, u in zip(jax.grad(lambda s, v: (fused(s, v, key) ** 2).sum(), argnums=(0, 1))(scores, value),
                    jax.grad(lambda s, v: (unfused(s, v, key) ** 2).sum(), argnums=(0, 1))(scores, value)):
        np.testing.assert_allclose(np.asarray(f), np.asarray(u), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(fused(scores, value, key)), np.asarray(unfused(scores, value, key)),
                               rtol=1e-5, atol=1e-5)
    assert kernels(fused, scores, value, key, dead_code_removed=True) == 1
    # torch's softmax was traced, then dropped, dead: the kernel computes it.
    jaxpr, _ = partial_eval.dce_jaxpr(jax.make_jaxpr(fused)(scores, value, key).jaxpr, [True])
    assert "reduce_max" not in {str(equation.primitive) for equation in _equations(jaxpr)}


@pytest.mark.usefixtures("in_env")
def test_traced_eager_attention_of_query_and_key_is_one_attention_kernel_close_to_unfused():
    """Eager attention's scores q @ k.T / c + mask, softmax, dropout and product: one attention
    kernel (threefry: the unfused dropout's mask), values and gradients within float32 rounding."""
    def eager_attention(fuse_matmul):
        def attention(q, k, v, mask, key):
            with ENV, torch_pallas.seeds.key_scope(torch_view(key)), \
                    torch_pallas.route_dropout(impl="threefry", fuse_matmul=fuse_matmul):
                q, k, v, mask = (torch_view(t) for t in (q, k, v, mask))
                scores = torch.matmul(q, k.transpose(-1, -2)) / 8.0 + mask
                return jax_view(F.dropout(F.softmax(scores, dim=-1), 0.5) @ v)
        return jax.jit(attention)

    rng = np.random.default_rng(3)
    q, k, v = (jax_view(jax_tensor(rng.standard_normal((2, 4, 16, 32)).astype(np.float32))) for _ in range(3))
    mask = jax_view(jax_tensor(rng.standard_normal((2, 1, 1, 16)).astype(np.float32)))
    key = jax_view(torch_pallas.seeds.key_data(seed=6))
    fused, unfused = eager_attention(True), eager_attention(False)
    for f, u in zip(jax.grad(lambda *a: (fused(*a, key) ** 2).sum(), argnums=(0, 1, 2, 3))(q, k, v, mask),
                    jax.grad(lambda *a: (unfused(*a, key) ** 2).sum(), argnums=(0, 1, 2, 3))(q, k, v, mask)):
        np.testing.assert_allclose(np.asarray(f), np.asarray(u), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(fused(q, k, v, mask, key)), np.asarray(unfused(q, k, v, mask, key)),
                               rtol=1e-5, atol=1e-5)
    jaxpr, _ = partial_eval.dce_jaxpr(jax.make_jaxpr(fused)(q, k, v, mask, key).jaxpr, [True])
    primitives = [str(equation.primitive) for equation in _equations(jaxpr)]
    assert primitives.count("pallas_call") == 1 and "dot_general" not in primitives  # no scores outside it


def _equations(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs its equations call, but not into kernels."""
    for equation in jaxpr.eqns:
        yield equation
        if equation.primitive.name != "pallas_call":
            for sub in jax.extend.core.jaxprs_in_params(equation.params):
                yield from _equations(sub)


def test_compile_backend_names_what_to_use_on_torchax():
    # torch.compile(backend="torch_pallas") calls this (the package's entry point) with dynamo's graph.
    with pytest.raises(RuntimeError, match="compiles with torch_xla, which is not installed; on torchax, jit"):
        residual_fusion.backend(torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph()), [])


@pytest.mark.usefixtures("in_env")
def test_traced_linear_of_a_dropout_is_one_kernel_with_the_unfused_values():
    """LoRA's lora_A(dropout(x)) in a JAX trace: dropout_linear with the dropout's key (the default
    impl's mask), the dropout's own kernel dead."""
    rng = np.random.default_rng(2)
    x, weight = (jax_view(jax_tensor(rng.integers(-8, 8, shape).astype(np.float32))) for shape in ((2, 16, 256),
                                                                                                    (16, 256)))
    key = jax_view(torch_pallas.seeds.key_data(seed=3))

    def lora_down(fuse_linear):
        def down(x, weight, key):
            with ENV, torch_pallas.seeds.key_scope(torch_view(key)), \
                    torch_pallas.route_dropout(fuse_linear=fuse_linear):
                return jax_view(F.linear(F.dropout(torch_view(x), 0.5), torch_view(weight)))
        return jax.jit(down)

    fused, unfused = lora_down(True), lora_down(False)
    np.testing.assert_array_equal(np.asarray(fused(x, weight, key)), np.asarray(unfused(x, weight, key)))
    assert kernels(fused, x, weight, key, dead_code_removed=True) == 1
    assert "dropout_linear" in str(jax.make_jaxpr(fused)(x, weight, key))
