"""``torch_pallas::sample``: a uniform, normal or Bernoulli tensor from key data."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from torch_pallas import bridge, sharding as sharding_
from torch_pallas._checks import jax_dtype_name
from torch_pallas.ops import _autograd
from torch_pallas.kernels import sampling as sampling_kernels


def _output_dtype(distribution: str, dtype: torch.dtype) -> torch.dtype:
    return torch.bool if distribution == "bernoulli" else dtype


def _sample(key_data: torch.Tensor, shape: Sequence[int], distribution: str, dtype: torch.dtype,
            p: float, impl: str, sharding: Optional[str] = None) -> torch.Tensor:
    """Samples ``shape`` from ``distribution`` on key_data's XLA device; arguments pre-checked.
    With ``sharding`` (torch_xla's text for an SPMD sharding), the output is sharded so and
    each device draws its own shard of the unsharded tensor."""
    out_dtype = _output_dtype(distribution, dtype)
    shape = tuple(shape)
    if 0 in shape:
        return torch.empty(shape, dtype=out_dtype, device=key_data.device)
    options = dict(distribution=distribution, dtype=jax_dtype_name(dtype), p=p, impl=impl)
    if sharding is not None:
        local_shape = sharding_.Sharding.parse(sharding, len(shape)).shard_shape(shape)
        return sharding_.call(sampling_kernels.sample, sharding, [key_data], [(None,)], [tuple(range(len(shape)))],
                              noise_shape=shape, shape=local_shape, **options)
    return bridge.call(sampling_kernels.sample, key_data, shape=shape, **options)


sample_op = torch.library.custom_op("torch_pallas::sample", _sample, mutates_args=())
sample = _autograd.direct(sample_op, _sample)


@sample_op.register_fake
def _(key_data, shape, distribution, dtype, *options):
    return key_data.new_empty(tuple(shape), dtype=_output_dtype(distribution, dtype))
