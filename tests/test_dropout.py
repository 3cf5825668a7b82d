"""torch_pallas.dropout: mask contract, gradients from the regenerated mask, saved bytes,
seeds, shapes and dtypes, checkpointing, statistics, bad input."""

import math
import subprocess
import sys

import numpy as np
import jax
import pytest
import torch
import torch_xla
import torch_xla.debug.metrics as met
import torch_xla.utils.checkpoint

import torch_pallas
from conftest import on_a_device_without_front_end
from reference import (SEEDS, attention_tiled_keep, dropout_keep, jax_key, keep_probability, tiled_bits,
                       tiled_keep_from_bits)
from torch_pallas.ops import dropout as dropout_op

SHAPE = (20, 300)


def xla(t):
    return t.to(torch_xla.device())


def positive(shape, dtype=torch.float32):
    """Inputs without zeros, so that the mask is exactly (output != 0)."""
    return xla(torch.rand(shape, generator=torch.Generator().manual_seed(0)).add(0.5).to(dtype))


# The default impl (tiled) and threefry, whose mask is jax.random.bernoulli's.
IMPLS = [pytest.param(None, id="default-tiled"), pytest.param("threefry", id="threefry")]


@pytest.mark.parametrize("impl", IMPLS)
def test_mask_is_the_impls_and_gradient_uses_it(impl):
    """docs/tour-xla.md, Dropout, and docs/noise.md, Dropout's mask: the default impl's (tiled) mask,
    jax.random.bernoulli's with impl="threefry"; the backward regenerates it."""
    x = positive(SHAPE).requires_grad_()
    y = torch_pallas.dropout(x, p=0.3, seed=SEEDS[2], impl=impl)
    y.backward(xla(torch.ones(SHAPE)))
    keep, q = dropout_keep(SEEDS[2], SHAPE, 0.3, impl or "tiled")
    np.testing.assert_array_equal(y.detach().cpu().numpy() != 0, keep)
    expected_grad = np.where(keep, np.float32(1) / q, 0).astype(np.float32)
    np.testing.assert_allclose(x.grad.cpu().numpy(), expected_grad, rtol=2e-7)
    np.testing.assert_allclose(y.detach().cpu().numpy(), np.where(keep, x.detach().cpu().numpy() / q, 0), rtol=2e-7)


def test_saves_only_the_key_for_backward():
    x = positive(SHAPE).requires_grad_()
    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        torch_pallas.dropout(x, p=0.5).sum().backward()
    assert saved == [8]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        torch.nn.functional.dropout(x, p=0.5)
    assert sum(saved[1:]) >= x.numel()  # torch keeps a mask of at least a byte per element


def test_forced_different_forward_and_backward_blocks_agree():
    x = positive((64, 1024)).requires_grad_()
    key = torch_pallas.seeds.key_data(seed=SEEDS[1])
    y = dropout_op.dropout(x, key, 0.4, "threefry", False, [8, 128], [40, 256])
    y.backward(xla(torch.ones(64, 1024)))
    torch.testing.assert_close(x.grad.cpu() != 0, y.detach().cpu() != 0, rtol=0, atol=0)
    default = torch_pallas.dropout(x.detach(), p=0.4, seed=SEEDS[1], impl="threefry")
    assert torch.equal(default.cpu(), y.detach().cpu())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_dtypes(dtype):
    x = positive(SHAPE, dtype).requires_grad_()
    y = torch_pallas.dropout(x, p=0.3, seed=SEEDS[1])
    assert y.dtype == dtype
    keep, _ = dropout_keep(SEEDS[1], SHAPE, 0.3)
    np.testing.assert_array_equal(y.detach().float().cpu().numpy() != 0, keep)
    y.float().sum().backward()
    assert x.grad.dtype == dtype
    np.testing.assert_array_equal(x.grad.float().cpu().numpy() != 0, keep)


def test_mask_shared_over_first_dim_is_one_jax_mask_for_every_step():
    x = positive((6, 3, 130)).requires_grad_()
    y = torch_pallas.dropout(x, 0.4, seed=SEEDS[1], shared_over_first_dim=True, impl="threefry")
    keep = np.asarray(jax.random.bernoulli(jax_key(SEEDS[1]), 0.6, (3, 130)))
    np.testing.assert_array_equal(y.detach().cpu().numpy() != 0, np.broadcast_to(keep, (6, 3, 130)))
    y.sum().backward()
    np.testing.assert_array_equal(x.grad.cpu().numpy() != 0, np.broadcast_to(keep, (6, 3, 130)))


def test_non_contiguous_input_gets_the_mask_of_its_logical_layout():
    """docs/limits.md, Sizes, compiles and layouts: non-contiguous inputs get the mask of their logical layout."""
    base = positive((300, 20))
    transposed = base.t()
    y = torch_pallas.dropout(transposed, p=0.3, seed=SEEDS[1])
    assert torch.equal(y.cpu(), torch_pallas.dropout(transposed.contiguous(), p=0.3, seed=SEEDS[1]).cpu())


@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 5), (3, 5, 129)])
def test_any_rank_and_empty(shape):
    x = positive(shape).requires_grad_()
    y = torch_pallas.dropout(x, p=0.5, seed=1)
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape


def test_identity_and_zero_cases():
    x = positive(SHAPE).requires_grad_()
    assert torch_pallas.dropout(x, p=0.0) is x
    assert torch_pallas.dropout(x, p=0.7, training=False) is x
    zeros = torch_pallas.dropout(x, p=1.0)
    zeros.sum().backward()
    assert not zeros.detach().cpu().any() and not x.grad.cpu().any()


def test_seed_sources():
    """docs/tour-xla.md, Dropout, and docs/noise.md, Where a call's key comes from: explicit seed, CPU
    generator, torch_xla.manual_seed."""
    x = positive(SHAPE)
    assert torch.equal(torch_pallas.dropout(x, seed=3).cpu(), torch_pallas.dropout(x, seed=3).cpu())
    with_generator = [torch_pallas.dropout(x, generator=torch.Generator().manual_seed(9)).cpu() for _ in range(2)]
    assert torch.equal(*with_generator)
    torch_xla.manual_seed(4)
    fresh = [torch_pallas.dropout(x).cpu() for _ in range(2)]
    assert not torch.equal(*fresh)
    torch_xla.manual_seed(4)
    assert torch.equal(torch_pallas.dropout(x).cpu(), fresh[0])


def test_checkpointed_recompute_uses_the_same_mask():
    torch.manual_seed(0)
    layer = torch.nn.Linear(300, 300).to(torch_xla.device())

    def block(inputs):
        return torch.tanh(torch_pallas.dropout(layer(inputs), p=0.5))

    def gradients(checkpointed):
        layer.zero_grad()
        x = positive(SHAPE).requires_grad_()  # reentrant checkpointing needs an input with grad
        torch_xla.manual_seed(21)
        out = torch_xla.utils.checkpoint.checkpoint(block, x) if checkpointed else block(x)
        out.square().sum().backward()
        return layer.weight.grad.cpu().clone(), x.grad.cpu()

    plain, checkpointed = gradients(False), gradients(True)
    assert plain[0].abs().sum() > 0
    for expected, got in zip(plain, checkpointed):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_fraction_and_independence(p):
    rows, cols = 1024, 1024
    kept = (torch_pallas.dropout(xla(torch.ones(rows, cols)), p=p, seed=SEEDS[3]).cpu() != 0).double()
    n = rows * cols
    assert abs(kept.mean().item() - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n)
    centred = kept - kept.mean()
    variance = centred.square().mean().item()
    for neighbours in (centred[1:] * centred[:-1], centred[:, 1:] * centred[:, :-1]):
        correlation = neighbours.mean().item() / variance
        assert abs(correlation) < 5 / math.sqrt(neighbours.numel())
    assert torch.unique(kept, dim=0).shape[0] == rows, "repeated rows"
    blocks = kept.reshape(rows // 8, 8, cols // 128, 128).permute(0, 2, 1, 3).reshape(-1, 8 * 128)
    assert torch.unique(blocks, dim=0).shape[0] == blocks.shape[0], "repeated (8, 128) blocks"


@pytest.mark.parametrize("call,error,match", [
    (lambda x: torch_pallas.dropout(x, p=1.5), ValueError, "p must be in"),
    (lambda x: torch_pallas.dropout(x, p=-0.1), ValueError, "p must be in"),
    (lambda x: torch_pallas.dropout(x, p=float("nan")), ValueError, "p must be in"),
    (lambda x: torch_pallas.dropout(x.long(), p=0.5), TypeError, "float32, bfloat16, float16 or float64"),
    (lambda x: torch_pallas.dropout(x > 0, p=0.5), TypeError, "float32, bfloat16, float16 or float64"),
    (lambda x: torch_pallas.dropout(on_a_device_without_front_end(*x.shape), p=0.5), ValueError,
     r"x\.to\(torch_xla\.device\(\)\)"),
    (lambda x: torch_pallas.dropout(x, p=0.5, seed=-1), ValueError, "seed"),
    (lambda x: torch_pallas.dropout(x, p=0.5, seed=2**64), ValueError, "seed"),
    (lambda x: torch_pallas.dropout(x, p=0.5, impl="philox"), ValueError, "impl"),
    (lambda x: torch_pallas.dropout(x.numpy(force=True), p=0.5), TypeError, "torch.Tensor"),
])
def test_bad_input_raises_and_leaves_input_untouched(call, error, match):
    x = positive(SHAPE)
    before = x.cpu().clone()
    with pytest.raises(error, match=match):
        call(x)
    assert torch.equal(x.cpu(), before)


@pytest.mark.parametrize("training,p", [(False, 0.5), (True, 0.0), (True, 1.0)])
def test_arguments_are_checked_even_when_no_kernel_runs(training, p):
    x = positive(SHAPE)
    with pytest.raises(ValueError, match="not both"):
        torch_pallas.dropout(x, p, training, seed=1, generator=torch.Generator())
    with pytest.raises(ValueError, match="seed"):
        torch_pallas.dropout(x, p, training, seed=-1)
    with pytest.raises(TypeError, match="generator"):
        torch_pallas.dropout(x, p, training, generator=3)
    with pytest.raises(ValueError, match="impl"):
        torch_pallas.dropout(x, p, training, impl="philox")


def test_shared_mask_needs_a_dimension():
    with pytest.raises(ValueError, match="shared_over_first_dim"):
        torch_pallas.dropout(positive(()), 0.5, shared_over_first_dim=True)


@pytest.mark.skipif(torch_pallas.bridge.on_tpu(), reason="hardware is available on TPU")
def test_hardware_impl_off_tpu_names_threefry():
    with pytest.raises(ValueError, match="impl='threefry'"):
        torch_pallas.dropout(positive(SHAPE), impl="hardware")


def test_tiled_impl_is_its_reference_and_the_backward_regenerates_its_mask():
    """docs/noise.md, The generators: impl="tiled" through the torch layer, forward and backward
    (the kernels' own tests: tests/kernels/test_tiled.py)."""
    shape, p = (6, 1000, 128), 0.1
    x = positive(shape).requires_grad_()
    y = torch_pallas.dropout(x, p=p, seed=1234, impl="tiled")
    y.backward(xla(torch.ones(shape)))
    keep = tiled_keep_from_bits(tiled_bits(1234, shape, 16), p)
    np.testing.assert_array_equal(y.detach().cpu().numpy() != 0, keep)
    np.testing.assert_array_equal(x.grad.cpu().numpy() != 0, keep)
    np.testing.assert_allclose(x.grad.cpu().numpy()[keep], 1 / (58982 / 65536), rtol=2e-7)


@pytest.mark.tpu
def test_hardware_dropout_on_tpu():
    p, n = 0.3, 1024 * 1024
    x = positive((1024, 1024)).requires_grad_()
    y = torch_pallas.dropout(x, p=p, seed=1, impl="hardware")
    y.sum().backward()
    kept = (y.detach().cpu() != 0)
    assert abs(kept.double().mean().item() - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n)
    assert torch.equal(kept, x.grad.cpu() != 0), "backward regenerated a different mask"
    assert torch.equal(y.detach().cpu(), torch_pallas.dropout(x.detach(), p=p, seed=1, impl="hardware").cpu())


def _seeded_dropout(x):
    return torch_pallas.dropout(x, 0.5, seed=3)


def test_torch_func_grad_vjp_and_jvp_use_the_forward_mask():
    x = positive((8, 128))
    masked_scale = _seeded_dropout(x) / x  # 2 where kept, 0 where dropped
    grad = torch.func.grad(lambda x: _seeded_dropout(x).sum())(x)
    _, vjp = torch.func.vjp(_seeded_dropout, x)
    _, tangent = torch.func.jvp(_seeded_dropout, (x,), (torch.ones_like(x),))
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(x, torch.ones_like(x))
        forward_ad = torch.autograd.forward_ad.unpack_dual(_seeded_dropout(dual)).tangent
    for got in (grad, vjp(torch.ones_like(x))[0], tangent, forward_ad):
        torch.testing.assert_close(got.cpu(), masked_scale.cpu(), rtol=0, atol=0)


def test_torch_func_under_torch_compile():
    x = positive((8, 128))
    masked_scale = (_seeded_dropout(x) / x).cpu()
    compiled_jvp = torch.compile(lambda x, t: torch.func.jvp(_seeded_dropout, (x,), (t,))[1], backend="openxla")
    compiled_grad = torch.compile(torch.func.grad(lambda x: _seeded_dropout(x).sum()), backend="openxla")
    torch.testing.assert_close(compiled_jvp(x, torch.ones_like(x)).cpu(), masked_scale, rtol=0, atol=0)
    torch.testing.assert_close(compiled_grad(x).cpu(), masked_scale, rtol=0, atol=0)


def test_vmap_randomness():
    samples = positive((3, 8, 128))
    with_seed = torch.func.vmap(_seeded_dropout)(samples)
    for sample, got in zip(samples, with_seed):  # a seed is one key: every sample gets its mask
        torch.testing.assert_close(got.cpu(), _seeded_dropout(sample).cpu(), rtol=0, atol=0)
    fresh = lambda x: torch_pallas.dropout(x, 0.5)  # noqa: E731
    same = torch.func.vmap(fresh, randomness="same")(samples) != 0
    different = torch.func.vmap(fresh, randomness="different")(samples) != 0
    assert torch.equal(same[0].cpu(), same[1].cpu()) and torch.equal(same[0].cpu(), same[2].cpu())
    assert not torch.equal(different[0].cpu(), different[1].cpu())
    with pytest.raises(RuntimeError, match="randomness"):
        torch.func.vmap(fresh)(samples)


def test_vmap_of_shared_mask_and_per_sample_gradients():
    sequences = positive((2, 5, 4, 128))
    shared = lambda x: torch_pallas.dropout(x, 0.5, seed=9, shared_over_first_dim=True)  # noqa: E731
    for sequence, got in zip(sequences, torch.func.vmap(shared)(sequences)):
        torch.testing.assert_close(got.cpu(), shared(sequence).cpu(), rtol=0, atol=0)
    per_sample = torch.func.vmap(torch.func.grad(lambda x: shared(x).sum()))(sequences)
    torch.testing.assert_close(per_sample.cpu(), (torch.func.vmap(shared)(sequences) / sequences).cpu(),
                               rtol=0, atol=0)


def test_inplace_writes_the_mask_into_x_as_torch_does():
    x = positive((16, 256))
    expected = torch_pallas.dropout(x, 0.5, seed=4).cpu()
    out = torch_pallas.dropout(x, 0.5, True, True, seed=4)
    assert out is x and torch.equal(x.cpu(), expected)


CHANNEL_CASES = [  # function, input shape, leading dims that get one mask element each (torch's rules)
    (torch_pallas.dropout1d, (4, 6, 33), 2), (torch_pallas.dropout1d, (6, 33), 1),
    (torch_pallas.dropout2d, (4, 6, 5, 7), 2),
    (torch_pallas.dropout3d, (2, 6, 3, 4, 5), 2), (torch_pallas.dropout3d, (6, 3, 4, 5), 1),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("function,shape,leading", CHANNEL_CASES)
def test_channel_dropout_mask_is_the_impls_over_channels_and_gradient_uses_it(function, shape, leading, impl):
    x = positive(shape).requires_grad_()
    y = function(x, 0.3, seed=SEEDS[1], impl=impl)
    y.sum().backward()
    keep, q = dropout_keep(SEEDS[1], shape[:leading], 0.3, impl or "tiled")
    scale = np.where(keep, np.float32(1) / q, 0).astype(np.float32)
    scale = np.broadcast_to(scale.reshape(shape[:leading] + (1,) * (len(shape) - leading)), shape)
    np.testing.assert_array_equal(x.grad.cpu().numpy(), scale)
    np.testing.assert_allclose(y.detach().cpu().numpy(), x.detach().cpu().numpy() * scale, rtol=2e-7)


def test_channel_dropout_follows_torch_for_odd_ranks():
    with pytest.warns(UserWarning, match="3D input to dropout2d"):  # torch's legacy (N, C, L) reading
        y = torch_pallas.dropout2d(positive((4, 6, 33)), 0.5, seed=1)
    assert torch.equal(y.cpu(), torch_pallas.dropout1d(positive((4, 6, 33)), 0.5, seed=1).cpu())
    with pytest.warns(UserWarning, match="Received a 3-D input to dropout3d"):
        torch_pallas.dropout3d(positive((6, 5, 7)), 0.5)
    for bad in ((33,), (2, 3, 4, 5)):
        with pytest.raises(ValueError, match="dropout1d"):
            torch_pallas.dropout1d(positive(bad), 0.5)
    x = positive((4, 6, 5, 7))
    assert torch_pallas.dropout2d(x, 0.5, training=False) is x
    assert torch.equal(torch_pallas.dropout2d(x, 1.0).cpu(), torch.zeros(4, 6, 5, 7))
    out = torch_pallas.dropout2d(x, 0.5, True, True, seed=2)
    assert out is x and torch.equal(x.cpu(), torch_pallas.dropout2d(positive((4, 6, 5, 7)), 0.5, seed=2).cpu())


def test_channel_dropout_under_vmap_and_jvp():
    # (32 channels: two samples' fresh masks are alike with probability 2**-32, not 6 channels' 1/64)
    samples = positive((3, 32, 35))
    fresh = lambda x: torch_pallas.dropout1d(x, 0.5)  # noqa: E731  (an unbatched (C, L) per sample)
    different = torch.func.vmap(fresh, randomness="different")(samples) != 0
    same = torch.func.vmap(fresh, randomness="same")(samples) != 0
    assert torch.equal(same[0].cpu(), same[1].cpu()) and not torch.equal(different[0].cpu(), different[1].cpu())
    seeded = lambda x: torch_pallas.dropout1d(x, 0.5, seed=3)  # noqa: E731
    _, tangent = torch.func.jvp(seeded, (samples,), (torch.ones_like(samples),))
    torch.testing.assert_close(tangent.cpu(), (seeded(samples) / samples).cpu(), rtol=0, atol=0)


def torch_dropout_given(keep, x, p):
    """torch's dropout (``x * mask``, mask = keep / (1 - p)) with a given keep mask, on the CPU."""
    mask = keep.cpu().to(x.dtype)
    return x.cpu() * (mask / (1 - p) if p < 1 else mask)


@pytest.mark.parametrize("p", [0.5, 1.0])
def test_nan_and_infinity_propagate_as_torch_dropout_forward_and_backward(p):
    """docs/noise.md, Precision: a dropped element is x * 0, as in torch's dropout."""
    values = torch.tensor([float("nan"), float("inf"), -float("inf"), -2.0, 3.0])
    x = xla(values.repeat(SHAPE[0] * SHAPE[1] // 5).reshape(SHAPE)).requires_grad_()
    grad = xla(values.flip(0).repeat(SHAPE[0] * SHAPE[1] // 5).reshape(SHAPE))
    y = torch_pallas.dropout(x, p, seed=SEEDS[1], impl="threefry")
    y.backward(grad)
    keep = torch_pallas.random.bernoulli(SHAPE, 1 - p, seed=SEEDS[1])  # threefry, sampling's default
    assert (~keep.cpu()).any()
    # A dropped NaN or infinity is NaN (x * 0), as in torch's; a dropped -2.0 is -0.0.
    torch.testing.assert_close(y.detach().cpu(), torch_dropout_given(keep, x.detach(), p), equal_nan=True,
                               rtol=2e-7, atol=0)
    torch.testing.assert_close(x.grad.cpu(), torch_dropout_given(keep, grad, p), equal_nan=True, rtol=2e-7, atol=0)
    assert torch.equal(torch.signbit(y.detach().cpu()), torch.signbit(torch_dropout_given(keep, x.detach(), p)))
    if p == 1.0:  # the same as torch's own dropout, mask or not
        torch.testing.assert_close(y.detach().cpu(), torch.nn.functional.dropout(x.detach().cpu(), p), equal_nan=True)


def test_float64_gets_the_float32_mask_and_is_scaled_in_float64():
    """docs/noise.md, Precision (float64), and docs/tensors.md, Dtypes (what dropout takes)."""
    x = positive(SHAPE, torch.float64).requires_grad_()
    y = torch_pallas.dropout(x, 0.3, seed=SEEDS[2])
    y.backward(xla(torch.ones(SHAPE, dtype=torch.float64)))
    keep = torch_pallas.dropout(positive(SHAPE), 0.3, seed=SEEDS[2]).cpu() != 0
    assert y.dtype == x.grad.dtype == torch.float64
    assert torch.equal(y.detach().cpu(), torch.where(keep, x.detach().cpu() / 0.7, 0.0))
    assert torch.equal(x.grad.cpu(), torch.where(keep, torch.ones((), dtype=torch.float64) / 0.7, 0.0))
    with torch_pallas.route_dropout():  # routed too (torch's dropout takes float64)
        torch_xla.manual_seed(3)
        routed = torch.nn.functional.dropout(x.detach(), 0.3)
    torch_xla.manual_seed(3)
    assert torch.equal(routed.cpu(), torch_pallas.dropout(x.detach(), 0.3).cpu())
    module_output = torch_pallas.nn.Dropout(0.3)(x.detach()).cpu()  # the module takes it too
    assert module_output.dtype == torch.float64
    assert ((module_output == 0) | (module_output == x.detach().cpu() / 0.7)).all()


def test_cpu_tensor_gets_the_xla_result_and_the_cpu_rng_with_autograd():
    """docs/tensors.md, Plain CPU tensors: the XLA result for the same seed, keys from
    torch.manual_seed, autograd and torch.func."""
    x_cpu = positive(SHAPE).cpu().requires_grad_()
    y = torch_pallas.dropout(x_cpu, 0.3, seed=SEEDS[3])
    assert y.device.type == "cpu"
    assert torch.equal(y.detach(), torch_pallas.dropout(xla(x_cpu.detach()), 0.3, seed=SEEDS[3]).cpu())
    y.backward(torch.ones(SHAPE))
    assert torch.equal(x_cpu.grad != 0, y.detach() != 0)
    # Without a seed, keys come from torch's CPU generator (torch.manual_seed).
    torch.manual_seed(5)
    first = torch_pallas.dropout(x_cpu, 0.3)
    torch.manual_seed(5)
    assert torch.equal(first, torch_pallas.dropout(x_cpu, 0.3))
    assert not torch.equal(first, torch_pallas.dropout(x_cpu, 0.3))
    # vmap's per-sample keys are views at an offset of one tensor (copied to aligned buffers).
    per_sample = torch.func.vmap(lambda t: torch_pallas.dropout(t, 0.5), randomness="different")(x_cpu.detach()[:4])
    assert per_sample.shape == (4, 300) and not torch.equal(per_sample[0] != 0, per_sample[1] != 0)
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        x = positive(SHAPE, dtype)
        assert torch.equal(torch_pallas.dropout(x.cpu(), 0.3, seed=1), torch_pallas.dropout(x, 0.3, seed=1).cpu())


def test_a_first_call_on_a_cpu_tensor_compiles_fullgraph():
    """A process whose first torch_pallas call on a CPU tensor is inside torch.compile(fullgraph=True)
    (run apart: this one has called already): the CPU front end is loaded at import, since dynamo
    cannot trace its import."""
    script = ("import torch, torch_pallas\n"
              "x = torch.randn(8, 128)\n"
              "y = torch.compile(lambda t: torch_pallas.dropout(t, 0.3, seed=1), fullgraph=True)(x)\n"
              "print(torch.equal(y, torch_pallas.dropout(x, 0.3, seed=1)))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.stdout.strip().endswith("True"), result.stdout + result.stderr[-2000:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dropout_add_is_residual_plus_dropout_with_its_mask_and_gradients(dtype):
    """docs/tour-xla.md, Dropout (dropout_add)."""
    x = xla(torch.randn(SHAPE, generator=torch.Generator().manual_seed(1))).to(dtype).requires_grad_()
    residual = xla(torch.randn(SHAPE, generator=torch.Generator().manual_seed(2))).to(dtype).requires_grad_()
    y = torch_pallas.dropout_add(x, residual, 0.3, seed=SEEDS[2])  # the default impl, tiled
    grad = xla(torch.randn(SHAPE, generator=torch.Generator().manual_seed(3))).to(dtype)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                  lambda t: t):
        torch_pallas.dropout_add(x, residual, 0.3, seed=SEEDS[2])
    assert saved == [8]
    y.backward(grad)
    keep, q = dropout_keep(SEEDS[2], SHAPE, 0.3)
    wide = [t.detach().cpu().double() for t in (x, residual, grad)]
    expected = torch.where(torch.from_numpy(keep), wide[0] / float(q), 0.0) + wide[1]
    # Computed in float32 and rounded once: within one float32 rounding of the exact sum.
    torch.testing.assert_close(y.detach().cpu().double(), expected.to(dtype).double(),
                               rtol=3e-7 if dtype == torch.float32 else 1e-2, atol=1e-6)
    assert torch.equal(x.grad.cpu(), torch_pallas.dropout(grad, 0.3, seed=SEEDS[2]).cpu())
    assert torch.equal(residual.grad.cpu(), grad.cpu())


def test_dropout_add_without_a_kernel_and_its_bad_input():
    x, residual = positive(SHAPE), positive(SHAPE) * 2
    assert torch.equal(torch_pallas.dropout_add(x, residual, 0.0).cpu(), (x + residual).cpu())
    assert torch.equal(torch_pallas.dropout_add(x, residual, 0.5, training=False).cpu(), (x + residual).cpu())
    assert torch.equal(torch_pallas.dropout_add(x, residual, 1.0).cpu(), residual.cpu())
    with pytest.raises(ValueError, match="residual must have x's shape"):
        torch_pallas.dropout_add(x, residual[:1], 0.5)
    with pytest.raises(TypeError, match="residual must have x's dtype"):
        torch_pallas.dropout_add(x, residual.bfloat16(), 0.5)
    with pytest.raises(ValueError, match="p must be in"):
        torch_pallas.dropout_add(x, residual, 1.5)
    with pytest.raises(TypeError, match="float32, bfloat16, float16 or float64"):
        torch_pallas.dropout_add(x.long(), residual.long(), 0.5)


def test_dropout_add_compiles_without_graph_breaks_or_recompiles():
    x, residual = positive(SHAPE), positive(SHAPE)
    step = torch.compile(lambda a, b: torch_pallas.dropout_add(a, b, 0.5), backend="openxla", fullgraph=True)
    kept, compiles = [], []
    for _ in range(4):
        x.grad = None
        x.requires_grad_()
        y = step(x, residual)
        y.sum().backward()
        torch_xla.sync()
        kept.append((y - residual).detach().cpu() != 0)
        assert torch.equal(x.grad.cpu() != 0, kept[-1])  # the backward's mask is the forward's
        compiles.append(met.metric_data("CompileTime")[0])
    assert compiles[1] == compiles[-1], compiles
    assert not torch.equal(kept[2], kept[3])  # a fresh key per call


WEIGHTS_SHAPE, VALUE_SHAPE = (2, 3, 40, 300), (2, 3, 300, 16)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # float16: the kernels' tests
def test_dropout_matmul_is_dropout_then_matmul_with_its_mask_and_gradients(dtype, impl):
    """docs/transformers.md, Fusion (dropout_matmul): float64 references given the impl's mask (the
    tiled impl's per attention tile, threefry's jax.random's); the backward pass keeps the weights,
    the value and the key, not the dropped weights."""
    generator = torch.Generator().manual_seed(5)
    weights = xla(torch.rand(WEIGHTS_SHAPE, generator=generator)).to(dtype).requires_grad_()
    value = xla(torch.randn(VALUE_SHAPE, generator=generator)).to(dtype).requires_grad_()
    grad = xla(torch.randn(2, 3, 40, 16, generator=generator)).to(dtype)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        out = torch_pallas.dropout_matmul(weights, value, 0.3, seed=SEEDS[2], impl=impl)
    assert saved == [WEIGHTS_SHAPE, VALUE_SHAPE, (2,)]
    out.backward(grad)
    keep = torch.from_numpy(dropout_keep(SEEDS[2], WEIGHTS_SHAPE, 0.3, impl)[0] if impl == "threefry"
                            else attention_tiled_keep(WEIGHTS_SHAPE, 0.3, SEEDS[2]))
    q = float(keep_probability(0.3, impl or "tiled"))
    w, v, g = (t.detach().cpu().double() for t in (weights, value, grad))
    # The kernel rounds a kept weight to the weights' dtype, as dropout does, then accumulates in float32.
    dropped = torch.where(keep, w / q, 0.0).to(dtype).double()
    expected = (dropped @ v, torch.where(keep, g @ v.transpose(-2, -1) / q, 0.0), dropped.transpose(-2, -1) @ g)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for got, want in zip((out, weights.grad, value.grad), expected):
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got.detach().cpu().double(), want, **tolerance)


def test_dropout_matmul_is_dropouts_mask_and_takes_what_matmul_takes():
    """threefry: the same weights dropped as torch_pallas.dropout's for the key; a pair the
    kernel does not take (a broadcast value, a vector) is computed as the weights dropped with
    the kernel's mask, then matmul; float64 weights (no kernel draws that mask) as dropout then
    matmul."""
    weights = positive(WEIGHTS_SHAPE)
    value = xla(torch.randn(VALUE_SHAPE, generator=torch.Generator().manual_seed(6)))
    dropped = torch_pallas.dropout(weights, 0.4, seed=7, impl="threefry")
    torch.testing.assert_close(torch_pallas.dropout_matmul(weights, value, 0.4, seed=7, impl="threefry").cpu(),
                               (dropped @ value).cpu(), rtol=1e-5, atol=1e-5)
    identity = xla(torch.eye(weights.shape[-1]).expand(*weights.shape[:-2], -1, -1).contiguous())
    kernels_dropped = torch_pallas.dropout_matmul(weights, identity, 0.4, seed=7)  # (exact: one 1 per column)
    for w, v, w_dropped in ((weights, value[0], kernels_dropped),
                            (weights[0, 0], value[0, 0, :, 0], kernels_dropped[0, 0])):
        assert torch.equal(torch_pallas.dropout_matmul(w, v, 0.4, seed=7).cpu(), (w_dropped @ v).cpu())
    assert torch.equal(torch_pallas.dropout_matmul(weights.double(), value.double(), 0.4, seed=7).cpu(),
                       (torch_pallas.dropout(weights.double(), 0.4, seed=7) @ value.double()).cpu())
    eager = torch_pallas.dropout_matmul(weights.cpu(), value.cpu(), 0.4, seed=7, impl="threefry")
    torch.testing.assert_close(eager, (dropped @ value).cpu(), rtol=1e-5, atol=1e-5)


def test_dropout_matmul_without_a_kernel_and_its_bad_input():
    weights, value = positive(WEIGHTS_SHAPE), positive(VALUE_SHAPE)
    for p, training in ((0.0, True), (0.5, False)):
        assert torch.equal(torch_pallas.dropout_matmul(weights, value, p, training).cpu(), (weights @ value).cpu())
    assert torch.equal(torch_pallas.dropout_matmul(weights, value, 1.0).cpu(), torch.zeros(2, 3, 40, 16))
    with pytest.raises(TypeError, match="value must have weights' dtype"):
        torch_pallas.dropout_matmul(weights, value.bfloat16(), 0.5)
    with pytest.raises(ValueError, match="value must be on weights' device"):
        torch_pallas.dropout_matmul(weights, value.cpu(), 0.5)
    with pytest.raises(TypeError, match="value must be a torch.Tensor"):
        torch_pallas.dropout_matmul(weights, value.cpu().numpy(), 0.5)
    with pytest.raises(ValueError, match="p must be in"):
        torch_pallas.dropout_matmul(weights, value, 1.5)
    with pytest.raises(RuntimeError):  # torch's own shape error, from its matmul
        torch_pallas.dropout_matmul(weights[..., :7], value, 0.5, training=False)


def test_dropout_matmul_compiles_without_graph_breaks_or_recompiles():
    weights, value = positive(WEIGHTS_SHAPE), positive(VALUE_SHAPE)
    step = torch.compile(lambda w, v: torch_pallas.dropout_matmul(w, v, 0.5), backend="openxla", fullgraph=True)
    compiles, outputs = [], []
    for _ in range(3):
        weights.grad = None
        weights.requires_grad_()
        out = step(weights, value)
        out.sum().backward()
        torch_xla.sync()
        outputs.append(out.detach().cpu())
        compiles.append(met.metric_data("CompileTime")[0])
    assert compiles[1] == compiles[-1], compiles
    assert not torch.equal(outputs[1], outputs[2])  # a fresh key per call
