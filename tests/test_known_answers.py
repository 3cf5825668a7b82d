"""The noise contract across stacks: torch_pallas on XLA tensors and on CPU tensors gives exactly
the committed values of tests/known_answers.py, which the torchax stack's
tests/torchax/test_known_answers.py checks too."""

import numpy as np
import pytest
import torch
import torch_xla

import known_answers as answers
import torch_pallas

DEVICES = [pytest.param(torch_xla.device(), id="xla"), pytest.param(torch.device("cpu"), id="cpu")]


@pytest.mark.parametrize("device", DEVICES)
def test_random_ops_give_the_committed_values(device):
    uniform = torch_pallas.random.uniform((4,), seed=answers.SEED, device=device)
    normal = torch_pallas.random.normal((4,), seed=answers.SEED, device=device)
    bernoulli = torch_pallas.random.bernoulli((16,), answers.BERNOULLI_P, seed=answers.SEED, device=device)
    assert uniform.device.type == device.type
    assert tuple(uniform.cpu().numpy().view(np.uint32)) == answers.UNIFORM_BITS
    assert tuple(normal.cpu().numpy().view(np.uint32)) == answers.NORMAL_BITS
    assert tuple(bernoulli.cpu().numpy().astype(int)) == answers.BERNOULLI


@pytest.mark.parametrize("impl,keep", [(None, answers.TILED_DROPOUT_KEEP), ("threefry", answers.DROPOUT_KEEP)],
                         ids=["default-tiled", "threefry"])
@pytest.mark.parametrize("device", DEVICES)
def test_dropout_keeps_the_committed_mask(device, impl, keep):
    y = torch_pallas.dropout(torch.ones(2, 16).to(device), answers.DROPOUT_P, seed=answers.SEED, impl=impl)
    np.testing.assert_array_equal(y.cpu().numpy(), np.asarray(keep, np.float32) / answers.DROPOUT_P)
