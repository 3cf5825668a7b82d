"""torch_pallas.random on torchax's ``jax`` device: bit for bit jax.random for the seed's key,
the default device, key sources, CPU tensors equal to torchax's, bad input."""

import numpy as np
import jax
import pytest
import torch

import torch_pallas
from reference import SEEDS, jax_key, ulp_distance
from torch_pallas import random as tp_random
from torchax_support import ENV, SHAPE, in_env, numpy  # noqa: F401  (in_env: fixture)

pytestmark = pytest.mark.usefixtures("in_env")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_uniform_matches_jax_on_the_jax_device(dtype):
    """docs/noise.md, The generators: jax.random.uniform(key, shape) for the seed's key."""
    got = tp_random.uniform(SHAPE, seed=SEEDS[2], dtype=dtype, device="jax")
    assert got.device.type == "jax" and got.dtype == dtype and tuple(got.shape) == SHAPE
    reference = jax.random.uniform(jax_key(SEEDS[2]), SHAPE, str(dtype).removeprefix("torch."))
    np.testing.assert_array_equal(np.asarray(got._elem, np.float32), np.asarray(reference, np.float32))


def test_normal_and_bernoulli_match_jax_and_default_to_the_jax_device():
    normal = tp_random.normal(SHAPE, seed=SEEDS[1])
    assert normal.device.type == "jax"
    assert ulp_distance(numpy(normal), jax.random.normal(jax_key(SEEDS[1]), SHAPE)) <= 4
    bernoulli = tp_random.bernoulli(SHAPE, 0.3, seed=SEEDS[1], device="jax")
    assert bernoulli.dtype == torch.bool
    np.testing.assert_array_equal(numpy(bernoulli), np.asarray(jax.random.bernoulli(jax_key(SEEDS[1]), 0.3, SHAPE)))


def test_key_sources():
    """seed= repeats, generator= repeats, torchax's RNG is fresh and follows env.manual_seed."""
    assert np.array_equal(numpy(tp_random.uniform(8, seed=5)), numpy(tp_random.uniform(8, seed=5)))
    drawn = [numpy(tp_random.uniform(8, generator=torch.Generator().manual_seed(1))) for _ in range(2)]
    assert np.array_equal(*drawn)
    ENV.manual_seed(3)
    fresh = [numpy(tp_random.uniform(8)) for _ in range(2)]
    assert not np.array_equal(*fresh)
    ENV.manual_seed(3)
    assert np.array_equal(numpy(tp_random.uniform(8)), fresh[0])


def test_cpu_device_gives_the_same_bits():
    """docs/tensors.md, Plain CPU tensors: the same noise on the CPU (DLPack) as on torchax's device."""
    for sample in (lambda device: tp_random.uniform(SHAPE, seed=SEEDS[3], device=device),
                   lambda device: tp_random.normal(SHAPE, seed=SEEDS[3], device=device),
                   lambda device: tp_random.bernoulli(SHAPE, 0.7, seed=SEEDS[3], device=device)):
        on_cpu, on_jax = sample("cpu"), sample("jax")
        assert on_cpu.device.type == "cpu" and on_jax.device.type == "jax"
        np.testing.assert_array_equal(numpy(on_cpu), numpy(on_jax))


@pytest.mark.parametrize("call, error, match", [
    (lambda: tp_random.uniform((2, -1), device="jax"), ValueError, "negative"),
    (lambda: tp_random.uniform((2, 2.0), device="jax"), TypeError, "ints"),
    (lambda: tp_random.uniform((2,), device="jax", dtype=torch.int32), TypeError, "dtype"),
    (lambda: tp_random.bernoulli((2,), 1.5, device="jax"), ValueError, "p"),
    (lambda: tp_random.uniform((2,), device="jax", impl="hardware"), ValueError, "hardware"),
    (lambda: tp_random.uniform((2,), device="cuda"), ValueError, "device must be"),
])
def test_bad_input_raises_as_on_xla(call, error, match):
    with pytest.raises(error, match=match):
        call()
