"""``torch_pallas::sample``: a uniform, normal or Bernoulli tensor from key data."""

from __future__ import annotations

from typing import Sequence

import torch

from torch_pallas import bridge
from torch_pallas._checks import jax_dtype_name
from torch_pallas.kernels import sampling as sampling_kernels


def _output_dtype(distribution: str, dtype: torch.dtype) -> torch.dtype:
    return torch.bool if distribution == "bernoulli" else dtype


@torch.library.custom_op("torch_pallas::sample", mutates_args=())
def sample(key_data: torch.Tensor, shape: Sequence[int], distribution: str, dtype: torch.dtype,
           p: float, impl: str) -> torch.Tensor:
    """Samples ``shape`` from ``distribution`` on key_data's XLA device; arguments pre-checked."""
    out_dtype = _output_dtype(distribution, dtype)
    if 0 in shape:
        return torch.empty(tuple(shape), dtype=out_dtype, device=key_data.device)
    return bridge.call(
        sampling_kernels.sample, key_data, shape=tuple(shape), distribution=distribution,
        dtype=jax_dtype_name(dtype), p=p, impl=impl)


@sample.register_fake
def _(key_data, shape, distribution, dtype, *options):
    return key_data.new_empty(tuple(shape), dtype=_output_dtype(distribution, dtype))
