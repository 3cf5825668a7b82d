"""torch_pallas inside JAX transformations of torch code on torchax tensors: a jitted training
step taking its key as an input (fresh masks per step, one trace, equal to eager), torchax.compile
and torchax.interop.jax_jit, the error for a draw without a key in a trace, jax.grad over a torch
function (the custom_vjp path), and torch.func."""

import numpy as np
import jax
import pytest
import torch
import torchax
import torchax.interop
from torchax.interop import jax_view, torch_view

import torch_pallas
from reference import SEEDS, dropout_keep, jax_key
from torchax_support import ENV, SHAPE, in_env, jax_tensor, numpy, positive, square_weight  # noqa: F401  (in_env: fixture)

pytestmark = pytest.mark.usefixtures("in_env")

FEATURES = SHAPE[1]


class Block(torch.nn.Module):
    """tanh(dropout(x @ weight)). Not nn.Linear: torchax runs F.linear from its function-mode
    table, above torch's autograd, so eager backward through it records nothing on torchax 0.0.13."""

    def __init__(self):
        super().__init__()
        self.weight = square_weight(FEATURES)
        self.dropout = torch.nn.Dropout(0.5)

    def forward(self, x):
        return torch.tanh(self.dropout(x @ self.weight))


def make_model():
    return Block().to("jax")


def test_jitted_step_with_its_key_as_input_draws_fresh_masks_traces_once_and_equals_eager():
    """docs/tour-torchax.md, A compiled step: a step that takes key data as an input (jax.value_and_grad of a
    torch function, as torchax's training helpers build one) is traced once and draws the
    masks of each step's key; eagerly, the same key gives the same masks and gradients."""
    model = torch_pallas.convert_dropout(make_model())
    assert isinstance(model.dropout, torch_pallas.nn.Dropout)
    params = {name: jax_view(parameter.detach()) for name, parameter in model.named_parameters()}
    x = positive((4, FEATURES))

    def loss_of(params, inputs, key):
        with ENV, torch_pallas.seeds.key_scope(torch_view(key)):
            hidden = torch.func.functional_call(model, torch_view(params), (torch_view(inputs),))
            return jax_view(hidden.square().sum()), jax_view(hidden)

    step = jax.jit(jax.value_and_grad(loss_of, has_aux=True))
    keys = [torch_pallas.seeds.key_data() for _ in range(3)]
    results = [step(params, jax_view(x), jax_view(key)) for key in keys]
    assert step._cache_size() == 1
    masks = [np.asarray(hidden) != 0 for (_, hidden), _ in results]
    assert not np.array_equal(masks[0], masks[1]) and not np.array_equal(masks[1], masks[2])

    # Eager, torch autograd, the first key
    parameters = {name: jax_tensor(np.asarray(value), requires_grad=True) for name, value in params.items()}
    with torch_pallas.seeds.key_scope(keys[0]):
        hidden = torch.func.functional_call(model, parameters, (x,))
    hidden.square().sum().backward()
    (loss, jitted_hidden), grads = results[0]
    np.testing.assert_array_equal(numpy(hidden) != 0, masks[0])
    np.testing.assert_allclose(numpy(hidden), np.asarray(jitted_hidden), rtol=1e-6, atol=1e-6)
    for name, grad in grads.items():
        assert np.abs(np.asarray(grad)).sum() > 0
        np.testing.assert_allclose(np.asarray(grad), numpy(parameters[name].grad), rtol=1e-5, atol=1e-5)


def test_torch_autograd_inside_a_jitted_function():
    """loss.backward() on torchax tensors inside jax.jit reaches the backward kernel with the
    forward's key: the gradient is the forward's mask over 1 - p."""

    def gradient(inputs, key):
        with ENV:
            x = torch_view(inputs).requires_grad_()
            with torch_pallas.seeds.key_scope(torch_view(key)):
                y = torch_pallas.dropout(x, 0.25, impl="threefry")  # jax.random's mask of the scope's key
            y.sum().backward()
            return jax_view(y.detach()), jax_view(x.grad)

    jitted = jax.jit(gradient)
    key = torch_pallas.seeds.key_data(seed=SEEDS[2])
    y, grad = jitted(jax_view(positive()), jax_view(key))
    keep = np.asarray(jax.random.bernoulli(jax.random.fold_in(jax_key(SEEDS[2]), 0), 0.75, SHAPE))
    np.testing.assert_array_equal(np.asarray(y) != 0, keep)
    np.testing.assert_allclose(np.asarray(grad), np.where(keep, 1 / 0.75, 0), rtol=2.5e-7)


@pytest.mark.parametrize("compiler", [torchax.compile, torchax.interop.jax_jit])
def test_torchax_compile_and_jax_jit_of_a_function_taking_its_key(compiler):
    """docs/tour-torchax.md, A compiled step: torchax.compile / interop.jax_jit of a torch function with a
    key_scope over its key input: fresh keys give fresh masks, a key gives eager's mask."""

    def function(x, key):
        with torch_pallas.seeds.key_scope(key):
            return torch_pallas.dropout(x, 0.5), torch_pallas.random.uniform((3,), device="jax")

    compiled = compiler(function)
    x = positive()
    keys = [torch_pallas.seeds.key_data() for _ in range(2)]
    outputs = [compiled(x, key) for key in keys]
    assert not np.array_equal(numpy(outputs[0][0]), numpy(outputs[1][0]))
    for key, (dropped, uniform) in zip(keys, outputs):
        eager_dropped, eager_uniform = function(x, key)
        np.testing.assert_array_equal(numpy(dropped), numpy(eager_dropped))
        np.testing.assert_array_equal(numpy(uniform), numpy(eager_uniform))
    with_seed = compiler(lambda x: torch_pallas.dropout(x, 0.5, seed=SEEDS[1]))(x)
    np.testing.assert_array_equal(numpy(with_seed), numpy(torch_pallas.dropout(x, 0.5, seed=SEEDS[1])))


@pytest.mark.parametrize("draw", [lambda x: torch_pallas.dropout(x, 0.5),
                                  lambda x: torch_pallas.random.normal((4,), device="jax") + x.sum()])
def test_a_draw_without_a_key_inside_a_trace_raises_and_leaves_the_rng_usable(draw):
    """docs/tour-torchax.md, A compiled step: no silently constant mask: a clear error naming key_scope."""
    before = ENV.param.prng
    with pytest.raises(RuntimeError, match="key_scope"):
        torchax.interop.jax_jit(draw)(positive())
    assert ENV.param.prng is before
    assert not np.array_equal(numpy(torch_pallas.dropout(positive(), 0.5)), numpy(torch_pallas.dropout(positive(), 0.5)))


def test_a_tracer_torchaxs_own_dropout_left_in_its_rng_gets_an_error_naming_the_fix():
    """torchax's own dropout inside jax.jit without a key leaves a tracer in its RNG; the next
    torch_pallas draw says so (and how to reseed) instead of JAX's UnexpectedTracerError."""
    with ENV.override_property(prng=jax.random.key(0)):  # the leak stays in this test
        torchax.interop.jax_jit(lambda x: torch.nn.functional.dropout(x, 0.5))(positive())
        with pytest.raises(RuntimeError, match="manual_seed"):
            torch_pallas.dropout(positive(), 0.5)


def test_override_property_prng_is_a_key_input_too():
    """torchax's own way to give a traced function its RNG key: env.override_property(prng=key)."""

    def function(inputs, key):
        with ENV, ENV.override_property(prng=key):
            return jax_view(torch_pallas.dropout(torch_view(inputs), 0.5))

    jitted = jax.jit(function)
    x = jax_view(positive())
    first, second = (jitted(x, jax.random.key(seed)) for seed in (1, 2))
    assert not np.array_equal(np.asarray(first), np.asarray(second))
    np.testing.assert_array_equal(np.asarray(first), np.asarray(jitted(x, jax.random.key(1))))
    assert jitted._cache_size() == 1


def test_jax_grad_over_a_torch_function_uses_the_regenerated_mask():
    """jax.grad of a torch function calling dropout (the custom_vjp built from the op's autograd
    formula) equals the float64 reference gradient: mask / (1 - p) times the upstream."""
    weights = np.random.default_rng(3).standard_normal(SHAPE).astype(np.float32)

    def loss(inputs):
        with ENV:
            return jax_view((torch_pallas.dropout(torch_view(inputs), 0.4, seed=SEEDS[2]) * jax_tensor(weights)).sum())

    grad = jax.grad(loss)(jax_view(positive()))
    keep, q = dropout_keep(SEEDS[2], SHAPE, 0.4)  # the default impl, tiled
    np.testing.assert_allclose(np.asarray(grad), np.where(keep, weights.astype(np.float64) / q, 0), rtol=3e-7)
    jitted = jax.jit(jax.grad(loss))(jax_view(positive()))
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(grad), rtol=2.5e-7)


def test_torch_func_grad_runs_plain_torch_ops_on_torchax_tensors():
    x = positive()
    np.testing.assert_allclose(numpy(torch.func.grad(lambda t: t.square().sum())(x)), 2 * numpy(x), rtol=1e-6)


@pytest.mark.parametrize("transform", ["grad", "vjp", pytest.param("jvp", marks=pytest.mark.xfail(
    strict=True, reason="torchax 0.0.13 has no lowering of aten::is_same_size, which forward-mode AD calls: "
                        "torch.func.jvp fails on torchax tensors before any torch_pallas op runs"))])
def test_torch_func_over_dropout(transform):
    """torch.func on torchax tensors: it wraps them in functorch tensors whose C++ device is
    meta (torchax's wrapper subclass reports 'jax' from Python only); torch_pallas reads the
    device of the tensor inside (bridge.device_of)."""
    x = positive()

    def function(t):
        return torch_pallas.dropout(t, 0.5, seed=SEEDS[1])

    if transform == "grad":
        grad = torch.func.grad(lambda t: function(t).sum())(x)
    elif transform == "vjp":
        _, pullback = torch.func.vjp(function, x)
        (grad,) = pullback(jax_tensor(np.ones(SHAPE, np.float32)))
    else:  # dropout is linear: the tangent goes through the same mask
        _, grad = torch.func.jvp(function, (x,), (jax_tensor(np.ones(SHAPE, np.float32)),))
    keep, _ = dropout_keep(SEEDS[1], SHAPE, 0.5)  # the default impl, tiled (its keep probability: 0.5)
    np.testing.assert_allclose(numpy(grad), np.where(keep, 2.0, 0.0))
