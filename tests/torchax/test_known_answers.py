"""The noise contract across stacks: torch_pallas on torchax tensors and on CPU tensors (the
DLPack front end) gives exactly the committed values of tests/known_answers.py, which the
torch_xla stack's tests/test_known_answers.py checks too."""

import numpy as np
import pytest
import torch

import known_answers as answers
import torch_pallas
from torchax_support import in_env, jax_tensor, numpy  # noqa: F401  (in_env: fixture)

pytestmark = pytest.mark.usefixtures("in_env")


@pytest.mark.parametrize("device", ["jax", "cpu"])
def test_random_ops_give_the_committed_values(device):
    uniform = torch_pallas.random.uniform((4,), seed=answers.SEED, device=device)
    normal = torch_pallas.random.normal((4,), seed=answers.SEED, device=device)
    bernoulli = torch_pallas.random.bernoulli((16,), answers.BERNOULLI_P, seed=answers.SEED, device=device)
    assert uniform.device.type == device
    assert tuple(numpy(uniform).view(np.uint32)) == answers.UNIFORM_BITS
    assert tuple(numpy(normal).view(np.uint32)) == answers.NORMAL_BITS
    assert tuple(numpy(bernoulli).astype(int)) == answers.BERNOULLI


@pytest.mark.parametrize("impl,keep", [(None, answers.TILED_DROPOUT_KEEP), ("threefry", answers.DROPOUT_KEEP)],
                         ids=["default-tiled", "threefry"])
@pytest.mark.parametrize("device", ["jax", "cpu"])
def test_dropout_keeps_the_committed_mask(device, impl, keep):
    ones = np.ones((2, 16), np.float32)
    x = jax_tensor(ones) if device == "jax" else torch.from_numpy(ones)
    y = torch_pallas.dropout(x, answers.DROPOUT_P, seed=answers.SEED, impl=impl)
    np.testing.assert_array_equal(numpy(y), np.asarray(keep, np.float32) / answers.DROPOUT_P)
