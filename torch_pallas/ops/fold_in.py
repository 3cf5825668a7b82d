"""``torch_pallas::fold_in``: a new key from key data and an integer, as ``jax.random.fold_in``."""

from __future__ import annotations

import torch

from torch_pallas import bridge
from torch_pallas.kernels import prng
from torch_pallas.ops import _autograd


def _jax_fold_in(key_data, *, data, interpret):
    del interpret  # plain XLA, no kernel
    return prng.fold_in(key_data, data)


def _fold_in(key_data: torch.Tensor, data: int) -> torch.Tensor:
    """int32 (2,) key data of ``jax.random.fold_in(key, data)``; ``data`` in [0, 2**32)."""
    return bridge.call(_jax_fold_in, key_data, data=data)


fold_in_op = torch.library.custom_op("torch_pallas::fold_in", _fold_in, mutates_args=())
fold_in = _autograd.direct(fold_in_op, _fold_in)


@fold_in_op.register_fake
def _(key_data, data):
    return torch.empty_like(key_data)
