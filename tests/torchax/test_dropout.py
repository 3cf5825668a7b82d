"""torch_pallas.dropout and its channel and residual forms on torchax tensors (device ``jax``),
eagerly with torch's autograd: the mask contract, gradients from the regenerated mask, saved
bytes, key sources, bad input."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest
import torch
from torchax.interop import jax_view, torch_view

import torch_pallas
from reference import SEEDS, dropout_keep, jax_key
from torch_pallas import frontends
from torchax_support import ENV, SHAPE, in_env, jax_tensor, numpy, positive  # noqa: F401  (in_env: fixture)

pytestmark = pytest.mark.usefixtures("in_env")


@pytest.mark.parametrize("impl", [None, "threefry"], ids=["default-tiled", "threefry"])
def test_mask_is_the_impls_and_gradient_uses_it(impl):
    """docs/noise.md, Dropout's mask: the default (tiled) impl's mask, with impl="threefry"
    jax.random.bernoulli(key, 1 - p, shape) for the seed's key, and the backward applies the same
    mask (against a float64 reference)."""
    x = positive(requires_grad=True)
    upstream = np.random.default_rng(1).standard_normal(SHAPE).astype(np.float32)
    y = torch_pallas.dropout(x, p=0.3, seed=SEEDS[2], impl=impl)
    assert y.device.type == "jax" and y.dtype == torch.float32
    y.backward(jax_tensor(upstream))
    keep, q = dropout_keep(SEEDS[2], SHAPE, 0.3, impl or "tiled")
    np.testing.assert_array_equal(numpy(y) != 0, keep)
    x64 = numpy(x).astype(np.float64)
    np.testing.assert_allclose(numpy(y), np.where(keep, x64 / q, 0), rtol=2.5e-7, atol=0)
    np.testing.assert_allclose(numpy(x.grad), np.where(keep, upstream.astype(np.float64) / q, 0),
                               rtol=2.5e-7, atol=0)


def test_saves_only_the_key_for_backward():
    """docs/noise.md, Dropout's mask: the forward saves the key data (8 bytes), never the mask."""
    x = positive(requires_grad=True)
    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        torch_pallas.dropout(x, p=0.5, seed=1).sum().backward()
    assert saved == [8]
    assert numpy(x.grad).any()


def test_seed_and_generator_repeat_and_draws_without_them_are_fresh():
    x = positive()
    assert np.array_equal(numpy(torch_pallas.dropout(x, seed=3)), numpy(torch_pallas.dropout(x, seed=3)))
    with_generator = [numpy(torch_pallas.dropout(x, generator=torch.Generator().manual_seed(9))) for _ in range(2)]
    assert np.array_equal(*with_generator)
    fresh = [numpy(torch_pallas.dropout(x)) for _ in range(2)]
    assert not np.array_equal(*fresh)


def test_manual_seed_of_torchaxs_environment_repeats_the_masks_as_torchaxs_dropout():
    """docs/noise.md, Where a call's key comes from: without seed or generator the key comes from torchax's RNG, which
    env.manual_seed seeds, as torchax's own F.dropout draws; torch.manual_seed after the
    environment has started reaches neither (see test_seeds for before it starts)."""
    x = positive()
    runs = []
    for _ in range(2):
        ENV.manual_seed(11)
        runs.append((numpy(torch_pallas.dropout(x, 0.5)), numpy(torch_pallas.dropout(x, 0.5)),
                     numpy(torch.nn.functional.dropout(x, 0.5))))
    for first_run, second_run in zip(*runs):  # ours twice, then torchax's F.dropout
        np.testing.assert_array_equal(first_run, second_run)
    assert not np.array_equal(runs[0][0], runs[0][1])  # two draws in one run differ
    outputs = []
    for _ in range(2):
        torch.manual_seed(11)
        outputs.append((numpy(torch_pallas.dropout(x, 0.5)), numpy(torch.nn.functional.dropout(x, 0.5))))
    assert not np.array_equal(outputs[0][0], outputs[1][0])
    assert not np.array_equal(outputs[0][1], outputs[1][1])  # torchax's own dropout alike


def test_dropout_add_is_residual_plus_dropout_with_its_gradients():
    """docs/tour-xla.md, Dropout (dropout_add, on torchax tensors): residual + dropout(x) with the same
    mask, gradients to both."""
    x = positive(requires_grad=True)
    residual = jax_tensor(np.full(SHAPE, 2.0, np.float32), requires_grad=True)
    y = torch_pallas.dropout_add(x, residual, 0.3, seed=SEEDS[1])  # the default impl, tiled
    keep, q = dropout_keep(SEEDS[1], SHAPE, 0.3)
    np.testing.assert_allclose(numpy(y), np.where(keep, numpy(x).astype(np.float64) / q, 0) + 2, rtol=3e-7)
    y.sum().backward()
    np.testing.assert_allclose(numpy(x.grad), np.where(keep, 1 / q, 0), rtol=2.5e-7)
    np.testing.assert_array_equal(numpy(residual.grad), np.ones(SHAPE, np.float32))


@pytest.mark.parametrize("function, shape, leading", [
    (torch_pallas.dropout1d, (4, 6, 33), 2), (torch_pallas.dropout2d, (4, 6, 5, 7), 2),
    (torch_pallas.dropout3d, (6, 3, 4, 5), 1)])
def test_channel_dropout_masks_whole_channels_with_the_default_impls_mask(function, shape, leading):
    """docs/noise.md, Dropout's mask (channel dropout): one draw of the default (tiled) impl per (sample, channel)."""
    x = positive(shape, requires_grad=True)
    y = function(x, 0.5, seed=SEEDS[1])
    keep, _ = dropout_keep(SEEDS[1], shape[:leading], 0.5)  # its keep probability at 0.5 is 0.5
    expected = np.broadcast_to(keep.reshape(keep.shape + (1,) * (len(shape) - leading)), shape)
    np.testing.assert_array_equal(numpy(y) != 0, expected)
    y.sum().backward()
    np.testing.assert_allclose(numpy(x.grad), np.where(expected, 2.0, 0.0))


def test_cpu_tensor_gets_the_same_bits_as_a_torchax_tensor():
    """docs/noise.md, Where a call's key comes from: the same seed gives the same noise on every front end
    (here DLPack's CPU tensors and torchax's), inside torchax's environment too."""
    values = np.random.default_rng(2).random(SHAPE).astype(np.float32) + 0.5
    on_jax = torch_pallas.dropout(jax_tensor(values), 0.4, seed=SEEDS[3])
    cpu_input = torch.from_numpy(values).requires_grad_()
    on_cpu = torch_pallas.dropout(cpu_input, 0.4, seed=SEEDS[3])
    assert type(on_cpu) is torch.Tensor and on_cpu.device.type == "cpu"
    np.testing.assert_array_equal(numpy(on_cpu).view(np.uint32), numpy(on_jax).view(np.uint32))
    on_cpu.sum().backward()
    np.testing.assert_array_equal(cpu_input.grad.numpy() != 0, numpy(on_jax) != 0)


@pytest.mark.parametrize("call, error, match", [
    (lambda x: torch_pallas.dropout(x, 1.5), ValueError, "p must be in"),
    (lambda x: torch_pallas.dropout(x, -0.1), ValueError, "p must be in"),
    (lambda x: torch_pallas.dropout(x, 0.5, impl="hardware"), ValueError, "hardware"),
    (lambda x: torch_pallas.dropout(x, 0.5, impl="philox"), ValueError, "impl"),
    (lambda x: torch_pallas.dropout(x, 0.5, seed=-1), ValueError, "seed"),
    (lambda x: torch_pallas.dropout(x, 0.5, seed=1.0), TypeError, "seed"),
    (lambda x: torch_pallas.dropout(x, 0.5, seed=1, generator=torch.Generator()), ValueError, "not both"),
    (lambda x: torch_pallas.dropout(x.int(), 0.5), TypeError, "x must be"),
    (lambda x: torch_pallas.dropout_add(x, x[:2], 0.5), ValueError, "residual"),
    (lambda x: torch_pallas.dropout2d(x[0], 0.5), ValueError, "channel"),
])
def test_bad_input_raises_as_on_xla_before_any_kernel(monkeypatch, call, error, match):
    """docs/tensors.md, Errors: the same errors as on XLA tensors, before anything runs."""
    x = positive()
    front_end = frontends.torchax

    def no_kernel(*args, **kwargs):
        raise AssertionError("a kernel ran")

    monkeypatch.setattr(front_end, "call", no_kernel)
    with pytest.raises(error, match=match):
        call(x)


def test_dropout_linear_is_the_unfused_call_eagerly_and_inside_jax_jit():
    """torch_pallas.dropout_linear on torchax tensors: F.linear(dropout(x)) with the same seed, values
    and gradients, eagerly and in a jitted JAX function of x and the weight."""
    rng = np.random.default_rng(4)
    x, weight = rng.standard_normal((2, 24, 256)).astype(np.float32), rng.standard_normal((16, 256)).astype(np.float32)

    def loss(function, x, weight):
        with ENV:
            return jax_view(function(torch_view(x), torch_view(weight)).square().sum())

    fused = lambda x, w: torch_pallas.dropout_linear(x, w, p=0.3, seed=SEEDS[1])  # noqa: E731
    unfused = lambda x, w: torch.nn.functional.linear(torch_pallas.dropout(x, 0.3, seed=SEEDS[1]), w)  # noqa: E731
    arrays = (jnp.asarray(x), jnp.asarray(weight))
    expected_loss, expected_grads = jax.value_and_grad(lambda *a: loss(unfused, *a), argnums=(0, 1))(*arrays)
    for run in (jax.value_and_grad, lambda f, **kw: jax.jit(jax.value_and_grad(f, **kw))):
        got_loss, got_grads = run(lambda *a: loss(fused, *a), argnums=(0, 1))(*arrays)
        np.testing.assert_allclose(np.asarray(got_loss), np.asarray(expected_loss), rtol=1e-5)
        for got, want in zip(got_grads, expected_grads):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    with ENV:
        y = torch_pallas.dropout_linear(jax_tensor(x), jax_tensor(weight), p=0.3, seed=SEEDS[1])
    assert y.device.type == "jax" and tuple(y.shape) == (2, 24, 16)
