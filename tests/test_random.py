"""torch_pallas.random: results bit for bit against jax.random, seeds, compile, bad input."""

import numpy as np
import jax
import pytest
import torch
import torch_xla
import torch_xla.debug.metrics as met

import torch_pallas
from reference import SEEDS, jax_key, ulp_distance
from torch_pallas import bridge, random as tp_random

SHAPE = (20, 300)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_uniform_matches_jax(dtype):
    got = tp_random.uniform(SHAPE, seed=SEEDS[2], dtype=dtype)
    assert got.device.type == "xla" and got.dtype == dtype and got.shape == SHAPE
    reference = jax.random.uniform(jax_key(SEEDS[2]), SHAPE, str(dtype).removeprefix("torch."))
    # Widening to float32 is exact and one-to-one, so equal floats mean equal bits.
    np.testing.assert_array_equal(got.cpu().float().numpy(), np.asarray(reference, np.float32))


def test_normal_matches_jax():
    got = tp_random.normal(SHAPE, seed=SEEDS[1])
    assert ulp_distance(got.cpu().numpy(), jax.random.normal(jax_key(SEEDS[1]), SHAPE)) <= 4


def test_bernoulli_matches_jax():
    got = tp_random.bernoulli(SHAPE, 0.3, seed=SEEDS[1])
    assert got.dtype == torch.bool
    np.testing.assert_array_equal(got.cpu().numpy(), np.asarray(jax.random.bernoulli(jax_key(SEEDS[1]), 0.3, SHAPE)))


def test_seed_sources():
    assert torch.equal(tp_random.uniform(8, seed=5).cpu(), tp_random.uniform(8, seed=5).cpu())
    a = tp_random.uniform(8, generator=torch.Generator().manual_seed(1)).cpu()
    b = tp_random.uniform(8, generator=torch.Generator().manual_seed(1)).cpu()
    assert torch.equal(a, b)
    torch_xla.manual_seed(2)
    fresh = [tp_random.uniform(8).cpu() for _ in range(2)]
    assert not torch.equal(*fresh)
    torch_xla.manual_seed(2)
    assert torch.equal(tp_random.uniform(8).cpu(), fresh[0])


def test_zero_sized_and_scalar_shapes():
    assert tp_random.uniform((0, 3)).shape == (0, 3)
    scalar = tp_random.normal((), seed=1)
    assert scalar.shape == ()


@pytest.mark.parametrize("call,error,match", [
    (lambda: tp_random.uniform((2, -1)), ValueError, "negative"),
    (lambda: tp_random.uniform((2, 1.5)), TypeError, "ints"),
    (lambda: tp_random.uniform("3"), TypeError, "shape"),
    (lambda: tp_random.uniform(3, seed=2**64), ValueError, "seed"),
    (lambda: tp_random.uniform(3, dtype=torch.int32), TypeError, "dtype"),
    (lambda: tp_random.normal(3, dtype=torch.float64), TypeError, "dtype"),
    (lambda: tp_random.uniform(3, impl="philox"), ValueError, "impl"),
    (lambda: tp_random.bernoulli(3, p=1.5), ValueError, "p must be in"),
    (lambda: tp_random.bernoulli(3, p=float("nan")), ValueError, "p must be in"),
    (lambda: tp_random.bernoulli(3, p="0.5"), TypeError, "p must be"),
    (lambda: tp_random.uniform(3, device="cuda"), ValueError, "XLA device"),
])
def test_bad_input_raises_before_any_kernel(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.skipif(torch_pallas.bridge.on_tpu(), reason="hardware is the TPU default")
def test_hardware_impl_off_tpu_names_threefry():
    with pytest.raises(ValueError, match="impl='threefry'"):
        tp_random.uniform(3, impl="hardware")


def _noisy(x):
    return x + tp_random.uniform(x.shape)


def test_compiled_sampling_fresh_reproducible_no_recompile():
    """docs/noise.md, Where a call's key comes from: under torch.compile, reproducible after warm-up
    and manual_seed, fresh each step."""
    compiled = torch.compile(_noisy, backend="openxla", fullgraph=True)
    x = torch.zeros(SHAPE, device=torch_xla.device())
    compiled(x)  # warm-up: traces and compiles
    torch_xla.sync()
    compiles = met.metric_data("CompileTime")[0]
    runs = []
    for _ in range(2):
        torch_xla.manual_seed(3)
        runs.append([compiled(x).cpu() for _ in range(3)])
    assert met.metric_data("CompileTime")[0] == compiles, "a compiled call compiled a new XLA graph"
    assert all(torch.equal(a, b) for a, b in zip(*runs)), "not reproducible after torch_xla.manual_seed"
    assert not torch.equal(runs[0][0], runs[0][1]), "the same numbers twice"


# --- TPU only ---------------------------------------------------------------------------

@pytest.mark.tpu
def test_hardware_uniform_statistics_on_tpu():
    n = 1024 * 1024
    u = tp_random.uniform((1024, 1024), seed=1, impl="hardware").cpu().double()
    assert abs(u.mean().item() - 0.5) < 5 * (1 / 12 / n) ** 0.5
    assert abs(u.var().item() - 1 / 12) < 0.002
    z = tp_random.normal((1024, 1024), seed=1, impl="hardware").cpu().double()
    assert abs(z.mean().item()) < 5 / n ** 0.5 and abs(z.var().item() - 1) < 0.01
    keep = tp_random.bernoulli((1024, 1024), 0.3, seed=1, impl="hardware").cpu().double()
    assert abs(keep.mean().item() - 0.3) < 5 * (0.3 * 0.7 / n) ** 0.5


@pytest.mark.tpu
def test_hardware_noise_has_no_repeated_tiles_on_tpu():
    u = tp_random.uniform((256, 1024), seed=2, impl="hardware").cpu()
    tiles = u.reshape(32, 8, 8, 128).permute(0, 2, 1, 3).reshape(-1, 8 * 128)
    assert len({tuple(t[:16].tolist()) for t in tiles}) == tiles.shape[0]
    assert not torch.equal(u, tp_random.uniform((256, 1024), seed=3, impl="hardware").cpu())


def test_default_impls_are_tiled_for_dropout_and_threefry_for_sampling_and_set_default_impl_sets_both():
    """docs/noise.md, The generators (the defaults, how to change them, and the line that restores
    the masks of before 2026-11-28); docs/changelog.md."""
    assert tp_random.get_default_impl() == tp_random.get_default_impl("dropout") == "tiled"
    assert tp_random.get_default_impl("sampling") == "threefry"
    with pytest.raises(ValueError, match="kind must be one of 'dropout', 'sampling', got 'noise'"):
        tp_random.get_default_impl("noise")
    with pytest.raises(ValueError, match="impl must be one of 'threefry', 'hardware', 'tiled', got 'philox'"):
        tp_random.set_default_impl("philox")
    if not bridge.on_tpu():
        with pytest.raises(ValueError, match="needs PJRT_DEVICE=TPU"):
            tp_random.set_default_impl("hardware")
    x = torch.ones(8, 128, device=torch_xla.device())
    tiled = torch_pallas.dropout(x, 0.5, seed=3).cpu()
    assert torch.equal(tiled, torch_pallas.dropout(x, 0.5, seed=3, impl="tiled").cpu())
    tp_random.set_default_impl("threefry")
    try:
        assert tp_random.get_default_impl("dropout") == tp_random.get_default_impl("sampling") == "threefry"
        assert torch.equal(torch_pallas.dropout(x, 0.5, seed=3).cpu(),
                           torch_pallas.dropout(x, 0.5, seed=3, impl="threefry").cpu())
        assert not torch.equal(torch_pallas.dropout(x, 0.5, seed=3).cpu(), tiled)
        tp_random.set_default_impl("tiled")
        assert torch.equal(tp_random.uniform((8, 128), seed=3).cpu(), tp_random.uniform((8, 128), seed=3,
                                                                                            impl="tiled").cpu())
    finally:
        tp_random.set_default_impl(None)
    assert (tp_random.get_default_impl("dropout"), tp_random.get_default_impl("sampling")) == ("tiled", "threefry")


@pytest.mark.parametrize("call", [
    lambda x: torch_pallas.dropout(x, 0.5), lambda x: torch_pallas.nn.Dropout(0.5)(x),
    lambda x: torch_pallas.dropout2d(x, 0.5), lambda x: tp_random.uniform(x.shape),
    lambda x: tp_random.bernoulli(x.shape)])
def test_every_random_op_without_impl_reads_the_default_and_names_the_environment_variable(monkeypatch, call):
    x = torch.ones(8, 128, device=torch_xla.device())
    monkeypatch.setenv("TORCH_PALLAS_NOISE_IMPL", "philox")
    tp_random.set_default_impl(None)  # back to the environment's choice
    try:
        with pytest.raises(ValueError, match=r"\$TORCH_PALLAS_NOISE_IMPL.*got 'philox'"):
            call(x)
        with pytest.raises(ValueError, match="TORCH_PALLAS_NOISE_IMPL"):
            torch_pallas.route_dropout()
    finally:
        monkeypatch.delenv("TORCH_PALLAS_NOISE_IMPL")
        tp_random.set_default_impl(None)
    assert tp_random.get_default_impl() == "tiled"


@pytest.mark.tpu
def test_set_default_impl_hardware_changes_the_noise_of_calls_without_impl():
    x = torch.ones(64, 1024, device=torch_xla.device())
    tiled = torch_pallas.dropout(x, 0.5, seed=3).cpu()
    tp_random.set_default_impl("hardware")
    try:
        default = torch_pallas.dropout(x, 0.5, seed=3).cpu()
        assert torch.equal(default, torch_pallas.dropout(x, 0.5, seed=3, impl="hardware").cpu())
        assert not torch.equal(default, tiled)
    finally:
        tp_random.set_default_impl(None)
