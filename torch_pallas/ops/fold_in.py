"""``torch_pallas::fold_in``: a new key from key data and an integer, as ``jax.random.fold_in``."""

from __future__ import annotations

import torch

from torch_pallas import bridge
from torch_pallas.kernels import prng


def _fold_in(key_data, *, data, interpret):
    del interpret  # plain XLA, no kernel
    return prng.fold_in(key_data, data)


@torch.library.custom_op("torch_pallas::fold_in", mutates_args=())
def fold_in(key_data: torch.Tensor, data: int) -> torch.Tensor:
    """int32 (2,) key data of ``jax.random.fold_in(key, data)``; ``data`` in [0, 2**32)."""
    return bridge.call(_fold_in, key_data, data=data)


@fold_in.register_fake
def _(key_data, data):
    return torch.empty_like(key_data)
