"""Keys on torchax's ``jax`` device: key data from a seed, key_scope's fold_in, and what makes a
run without seeds repeatable (torch.manual_seed before torchax's environment starts, as for
torchax's own dropout)."""

import os
import subprocess
import sys

import numpy as np
import jax
import pytest

import torch_pallas
from reference import SEEDS, jax_key, key_data
from torch_pallas import seeds
from torchax_support import in_env, numpy  # noqa: F401  (in_env: fixture)

pytestmark = pytest.mark.usefixtures("in_env")


@pytest.mark.parametrize("seed", SEEDS)
def test_key_data_from_a_seed_is_its_high_and_low_words_on_the_jax_device(seed):
    """docs/noise.md, Keys from seeds: the key of seed s is [s >> 32, s & 0xFFFFFFFF]."""
    key = seeds.key_data(seed=seed, device="jax")
    assert key.device.type == "jax"
    np.testing.assert_array_equal(numpy(key), key_data(seed))


def test_key_scope_draws_jax_fold_in_of_its_key():
    scope_key = seeds.key_data(seed=SEEDS[2])
    with seeds.key_scope(scope_key):
        drawn = [numpy(seeds.key_data()) for _ in range(2)]
    for index, words in enumerate(drawn):
        expected = jax.random.key_data(jax.random.fold_in(jax_key(SEEDS[2]), index))
        np.testing.assert_array_equal(words.view(np.uint32), np.asarray(expected))


SCRIPT = """
import sys
import numpy as np
import torch
torch.manual_seed(int(sys.argv[1]))  # before torchax's environment starts
import torchax
import torch_pallas
with torchax.default_env():
    x = torch.ones(64, device="jax")
    ours = [torch_pallas.dropout(x, 0.5) for _ in range(2)]
    theirs = torch.nn.functional.dropout(x, 0.5)
    print("".join("".join(str(int(v)) for v in (np.asarray(t._elem) != 0)) for t in (*ours, theirs)))
"""


@pytest.mark.own_process
def test_torch_manual_seed_before_the_environment_starts_repeats_a_run_as_torchaxs_dropout():
    """torchax seeds its RNG from torch.initial_seed() when its environment starts (later,
    env.manual_seed: test_dropout); torch_pallas's draws follow it as torchax's F.dropout does."""
    environment = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(sys.path))

    def run(seed):
        result = subprocess.run([sys.executable, "-c", SCRIPT, str(seed)], capture_output=True, text=True,
                                env=environment, timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        return result.stdout.split()[-1]

    first, again, other = run(3), run(3), run(4)
    assert first == again
    ours, theirs = first[:128], first[128:]
    assert ours[:64] != ours[64:]  # two draws in a run differ
    assert ours != other[:128] and theirs != other[128:]
