"""Helpers for tests/torchax: torchax's environment, tensors on its ``jax`` device made from
NumPy, and their values back as NumPy."""

import numpy as np
import jax.numpy as jnp
import pytest
import torch
import torchax
import torchax.interop

ENV = torchax.default_env()
SHAPE = (20, 300)


def jax_tensor(array, requires_grad=False) -> torch.Tensor:
    """A torchax tensor (device ``jax``) holding ``array``."""
    tensor = torchax.interop.torch_view(jnp.asarray(np.asarray(array)))
    return tensor.requires_grad_() if requires_grad else tensor


def positive(shape=SHAPE, requires_grad=False, dtype=np.float32) -> torch.Tensor:
    """Inputs without zeros, so that a dropout mask is exactly (output != 0)."""
    values = np.random.default_rng(0).random(shape).astype(dtype) + dtype(0.5)
    return jax_tensor(values, requires_grad)


def numpy(tensor) -> np.ndarray:
    """A torchax (or CPU) tensor's values."""
    if isinstance(tensor, torchax.tensor.Tensor):
        return np.asarray(tensor._elem)
    return tensor.detach().numpy()


def square_weight(features: int) -> torch.nn.Parameter:
    """A (features, features) weight for ``x @ weight``: test models use it instead of
    nn.Linear, whose F.linear torchax 0.0.13 runs above torch's autograd (eager backward
    through it records nothing)."""
    return torch.nn.Parameter(torch.randn(features, features, generator=torch.Generator().manual_seed(0))
                              / features ** 0.5)


@pytest.fixture
def in_env():
    """Runs the test inside torchax's environment, as torchax code runs."""
    with ENV:
        yield ENV
