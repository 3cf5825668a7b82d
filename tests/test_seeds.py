"""Seeds to key data: the contract of DESIGN.md, the three sources, and bad input."""

import numpy as np
import pytest
import torch
import torch_xla
import torch_xla.debug.metrics as met

from conftest import on_a_device_without_front_end
from reference import SEEDS, key_data as reference_key_data
from torch_pallas import seeds


@pytest.mark.parametrize("seed", SEEDS)
def test_key_data_from_seed_is_high_and_low_words(seed):
    data = seeds.key_data_from_seed(seed)
    assert data.dtype == torch.int32 and data.shape == (2,)
    np.testing.assert_array_equal(data.numpy(), reference_key_data(seed))
    assert (int(data[0]) & 0xFFFFFFFF) << 32 | (int(data[1]) & 0xFFFFFFFF) == seed


def test_explicit_seed_lands_on_the_xla_device():
    data = seeds.key_data(seed=SEEDS[2])
    assert data.device.type == "xla"
    np.testing.assert_array_equal(data.cpu().numpy(), reference_key_data(SEEDS[2]))


def test_generator_draws_reproducibly():
    first = seeds.key_data(generator=torch.Generator().manual_seed(3)).cpu()
    again = seeds.key_data(generator=torch.Generator().manual_seed(3)).cpu()
    other = seeds.key_data(generator=torch.Generator().manual_seed(4)).cpu()
    assert torch.equal(first, again) and not torch.equal(first, other)


def test_device_rng_is_fresh_reproducible_and_compiles_once():
    torch_xla.sync()  # nothing pending from earlier tests joins the first graph
    torch_xla.manual_seed(11)
    first = [seeds.key_data() for _ in range(3)]
    torch_xla.sync()
    compiles = met.metric_data("CompileTime")[0]
    torch_xla.manual_seed(11)
    again = [seeds.key_data() for _ in range(3)]
    torch_xla.sync()
    assert met.metric_data("CompileTime")[0] == compiles
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(first, again))
    assert len({tuple(k.cpu().tolist()) for k in first}) == 3


@pytest.mark.parametrize("seed,error", [
    (-1, ValueError), (2**64, ValueError), (1.0, TypeError), ("7", TypeError), (True, TypeError),
])
def test_bad_seed_raises(seed, error):
    with pytest.raises(error, match="seed"):
        seeds.key_data(seed=seed)


def test_numpy_integer_seed_is_accepted():
    np.testing.assert_array_equal(seeds.key_data_from_seed(np.uint64(2**64 - 1)).numpy(), [-1, -1])


def test_bad_generator_and_both_sources_raise():
    with pytest.raises(TypeError, match="generator"):
        seeds.key_data(generator=3)
    with pytest.raises(ValueError, match="not both"):
        seeds.key_data(seed=1, generator=torch.Generator())
    with pytest.raises(ValueError, match="device"):
        seeds.key_data(seed=1, device="cuda")


@pytest.mark.parametrize("seed", SEEDS[:2])
def test_key_scope_draws_jax_fold_in_of_its_key(seed):
    import jax
    from reference import jax_key

    def expected(i):
        return np.asarray(jax.random.key_data(jax.random.fold_in(jax_key(seed), np.uint32(i)))).view(np.int32)

    with seeds.key_scope(seeds.key_data(seed=seed)):
        draws = [seeds.key_data().cpu().numpy() for _ in range(3)]
        explicit = seeds.key_data(seed=seed).cpu().numpy()  # a seed is not a draw from the scope
        with seeds.key_scope(seeds.key_data(seed=7)):
            inner = seeds.key_data().cpu().numpy()
        after_inner = seeds.key_data().cpu().numpy()
    for i, draw in enumerate(draws + [after_inner]):
        np.testing.assert_array_equal(draw, expected(i))
    np.testing.assert_array_equal(explicit, reference_key_data(seed))
    assert not np.array_equal(inner, expected(3))


def test_key_scope_rejects_what_is_not_key_data():
    with pytest.raises(TypeError, match="key_data must be an int32 tensor of shape"):
        with seeds.key_scope(torch.zeros(2)):
            pass
    with pytest.raises(ValueError, match="key_data is on cuda"):
        with seeds.key_scope(on_a_device_without_front_end(2, dtype=torch.int32)):
            pass
