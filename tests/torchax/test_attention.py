"""torch_pallas.scaled_dot_product_attention on torchax tensors: values and gradients against
torch's attention on the CPU (causal, masks, GQA), its dropout against torch_pallas.dropout of
the weights with the same seed, under torch's autograd and inside ``jax.jit`` (a key input,
``jax.grad``), and route_dropout reaching F.scaled_dot_product_attention in either order of
entering it and torchax's environment."""

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchax

import torch_pallas
from attention_cases import CASES
from kernel_calls import record_dropout_keys

ENV = torchax.default_env()


def cpu(tensor):
    """A torchax tensor's values as a CPU tensor."""
    return torch.from_numpy(np.array(tensor.detach()._elem if hasattr(tensor, "_elem") else tensor.jax()))


def on_jax(tensor, grad=True):
    with ENV:
        moved = tensor.to("jax")
    return moved.requires_grad_() if grad else moved


def operands(query_shape, key_shape, value_shape, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator).requires_grad_() for shape in (query_shape, key_shape, value_shape)]


def weights_for(output, seed=1):
    return torch.randn(output.shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", CASES)
def test_output_and_gradients_equal_torchs_on_the_cpu(case):
    shapes, options = CASES[case]
    options = {name: value() if callable(value) else value for name, value in options.items()}
    tensors = operands(*shapes)
    expected = F.scaled_dot_product_attention(*tensors, **options)
    expected_grads = torch.autograd.grad((expected * weights_for(expected)).sum(), tensors)
    ours = [on_jax(t.detach()) for t in tensors]
    jax_options = {name: on_jax(value, grad=False) if isinstance(value, torch.Tensor) else value
                   for name, value in options.items()}
    with ENV:
        out = torch_pallas.scaled_dot_product_attention(*ours, **jax_options)
        assert isinstance(out, torchax.tensor.Tensor)
        grads = torch.autograd.grad((out * on_jax(weights_for(expected), grad=False)).sum(), ours)
    torch.testing.assert_close(cpu(out), expected.detach(), atol=2e-6, rtol=1e-5)
    for mine, wanted in zip(grads, expected_grads):
        torch.testing.assert_close(cpu(mine), wanted, atol=5e-6, rtol=1e-5)


def test_float32_operands_go_to_kernels_compiled_for_tpu_as_bfloat16_and_are_saved_so(monkeypatch):
    """tests/test_attention.py's test of the same name, on torchax: float32 query, key and value
    reach kernels compiled for a TPU (interpret mode standing in) as bfloat16, saved so."""
    from torch_pallas import bridge

    monkeypatch.setattr(bridge, "compiles_for_tpu", lambda tensor: True)
    tensors = operands((2, 2, 128, 64), (2, 2, 128, 64), (2, 2, 128, 64))
    ours = [on_jax(t.detach()) for t in tensors]
    saved = []
    with ENV, torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.dtype) or t, lambda t: t):
        out = torch_pallas.scaled_dot_product_attention(*ours, is_causal=True)
    with ENV:
        grads = torch.autograd.grad((out * on_jax(weights_for(out), grad=False)).sum(), ours)
    assert saved[:3] == [torch.bfloat16] * 3
    assert out.dtype == torch.float32 and all(grad.dtype == torch.float32 for grad in grads)
    rounded = [t.detach().to(torch.bfloat16).double().requires_grad_() for t in tensors]
    expected = F.scaled_dot_product_attention(*rounded, is_causal=True)
    torch.testing.assert_close(cpu(out).double(), expected, atol=1e-2, rtol=1e-2)
    for mine, wanted in zip(grads, torch.autograd.grad((expected * weights_for(expected).double()).sum(), rounded)):
        torch.testing.assert_close(cpu(mine).double(), wanted, atol=3e-2, rtol=2e-2)


def written_out(query, key, value, dropout_p, seed):
    """Attention with torch_pallas.dropout on the weights (causal), threefry: the mask attention's
    kernels draw with that impl."""
    scores = query @ key.transpose(-2, -1) / query.shape[-1] ** 0.5
    causal = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal.to(scores.device), float("-inf"))
    return torch_pallas.dropout(torch.softmax(scores, -1), dropout_p, seed=seed, impl="threefry") @ value


def test_dropout_is_torch_pallas_dropout_of_the_weights_and_gradients_follow_it():
    tensors = [on_jax(t.detach()) for t in operands((2, 3, 24, 16), (2, 3, 40, 16), (2, 3, 40, 8))]
    with ENV:
        ours = torch_pallas.scaled_dot_product_attention(*tensors, dropout_p=0.3, is_causal=True, seed=11,
                                                         impl="threefry")
        expected = written_out(*tensors, 0.3, 11)
        grads = torch.autograd.grad(ours.square().sum(), tensors)
        expected_grads = torch.autograd.grad(expected.square().sum(), tensors)
    torch.testing.assert_close(cpu(ours), cpu(expected), atol=2e-6, rtol=1e-5)
    for mine, wanted in zip(grads, expected_grads):
        torch.testing.assert_close(cpu(mine), cpu(wanted), atol=5e-6, rtol=1e-5)


def test_keys_come_from_torchaxs_rng_without_a_seed():
    query = on_jax(torch.randn(2, 2, 16, 16), grad=False)
    with ENV:
        attend = lambda **source: cpu(torch_pallas.scaled_dot_product_attention(query, query, query, dropout_p=0.5,
                                                                                  **source))
        assert torch.equal(attend(seed=3), attend(seed=3)) and not torch.equal(attend(seed=3), attend(seed=4))
        ENV.manual_seed(6)
        first, second = attend(), attend()
        ENV.manual_seed(6)
        assert not torch.equal(first, second) and torch.equal(attend(), first)


def jitted_attention_loss():
    """A JAX function of (query, key, value) arrays and key data: the loss of a torch function
    with attention dropout, keys from the key data (torch_pallas.seeds.key_scope)."""

    def loss(query, key, value, key_data):
        tensors = [torchax.tensor.Tensor(array, ENV) for array in (query, key, value)]
        with ENV, torch_pallas.seeds.key_scope(torchax.tensor.Tensor(key_data, ENV)):
            out = torch_pallas.scaled_dot_product_attention(*tensors, dropout_p=0.3, is_causal=True)
            return out.square().sum()._elem

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def test_inside_jax_jit_with_a_key_input_equals_eager_and_retraces_for_no_key():
    tensors = [on_jax(t.detach()) for t in operands((2, 2, 24, 16), (2, 2, 24, 16), (2, 2, 24, 16))]
    step = jitted_attention_loss()
    arrays = [t.detach()._elem for t in tensors]
    with ENV:
        keys = [torch_pallas.seeds.key_data() for _ in range(2)]
    (loss, grads), (other_loss, _) = (step(*arrays, key._elem) for key in keys)
    assert step._cache_size() == 1 and float(loss) != float(other_loss)  # fresh mask, no retrace
    # Eager torch autograd with the same key draws the same mask and gets the same gradients.
    with ENV, torch_pallas.seeds.key_scope(keys[0]):
        out = torch_pallas.scaled_dot_product_attention(*tensors, dropout_p=0.3, is_causal=True)
        expected_loss = out.square().sum()
        expected_grads = torch.autograd.grad(expected_loss, tensors)
    np.testing.assert_allclose(float(loss), cpu(expected_loss).item(), rtol=1e-5)
    for mine, wanted in zip(grads, expected_grads):
        np.testing.assert_allclose(np.asarray(mine), cpu(wanted).numpy(), atol=5e-6, rtol=1e-5)


def test_inside_jax_jit_without_a_key_input_raises():
    query = on_jax(torch.randn(2, 16, 8), grad=False)

    @jax.jit
    def attend(array):
        tensor = torchax.tensor.Tensor(array, ENV)
        with ENV:
            return torch_pallas.scaled_dot_product_attention(tensor, tensor, tensor, dropout_p=0.1)._elem

    with pytest.raises(RuntimeError, match="key_scope"):
        attend(query._elem)


@pytest.mark.parametrize("order", ["route-inside-env", "env-inside-route"])
def test_route_dropout_runs_sdpa_with_dropout_in_the_flash_kernel(order, monkeypatch):
    """torchax's function mode takes F.scaled_dot_product_attention itself (its reference
    attention, with torch.dropout on the weights); route_dropout still sees the call when
    torchax's environment is entered inside it, as torchax's training helpers do each step."""
    from torch_pallas.kernels import attention as attention_kernels
    from torch_pallas import bridge

    query = on_jax(torch.randn(2, 2, 16, 8))
    kernels, call = [], bridge.call
    monkeypatch.setattr(bridge, "call", lambda f, *t, **s: kernels.append(f) or call(f, *t, **s))
    keys = record_dropout_keys(monkeypatch)

    def attend():
        return F.scaled_dot_product_attention(query, query, query, dropout_p=0.25, is_causal=True)

    if order == "route-inside-env":
        with ENV, torch_pallas.route_dropout():
            out = attend()
    else:
        with torch_pallas.route_dropout(), ENV:
            out = attend()
    assert kernels == [attention_kernels.attention_forward] and len(keys) == 1
    with ENV:
        expected = torch_pallas.scaled_dot_product_attention(query, query, query, dropout_p=0.25, is_causal=True,
                                                             seed=0)
        out.sum().backward()
    assert attention_kernels.attention_backward in kernels
    assert out.shape == expected.shape and isinstance(out, torchax.tensor.Tensor)
    # Without dropout the call stays torchax's; with attention="all" it is ours too.
    kernels.clear()
    with torch_pallas.route_dropout(), ENV:
        plain = F.scaled_dot_product_attention(query, query, query)
    assert kernels == []
    with torch_pallas.route_dropout(attention="all"), ENV:
        routed = F.scaled_dot_product_attention(query, query, query)
    assert kernels == [attention_kernels.attention_forward]
    torch.testing.assert_close(cpu(routed), cpu(plain), atol=2e-6, rtol=1e-5)
