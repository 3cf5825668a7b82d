"""``torch_pallas::sample``: a uniform, normal or Bernoulli tensor from key data."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from torch_pallas import bridge, sharding
from torch_pallas._checks import jax_dtype_name
from torch_pallas.ops import _autograd
from torch_pallas.kernels import sampling as sampling_kernels
from torch_pallas.sharding import Sharding


def _output_dtype(distribution: str, dtype: torch.dtype) -> torch.dtype:
    return torch.bool if distribution == "bernoulli" else dtype


def _compute_sample(key_data: torch.Tensor, shape: Sequence[int], distribution: str, dtype: torch.dtype,
                    p: float, impl: str, sharding_text: Optional[str] = None,
                    global_shape: Optional[Sequence[int]] = None, global_offset: int = 0) -> torch.Tensor:
    """Samples ``shape`` from ``distribution`` on key_data's device; arguments pre-checked.
    With ``sharding_text`` (a :class:`~torch_pallas.sharding.Sharding`'s text), the output is
    sharded so and each device draws its own shard of the unsharded tensor. With
    ``global_shape``, the output is the block of ``shape`` of a tensor of ``global_shape`` at
    flat index ``global_offset`` (a DTensor's local shard: :mod:`torch_pallas.dtensors`)."""
    out_dtype = _output_dtype(distribution, dtype)
    shape = tuple(shape)
    if 0 in shape:
        return torch.empty(shape, dtype=out_dtype, device=key_data.device)
    options = dict(distribution=distribution, dtype=jax_dtype_name(dtype), p=p, impl=impl)
    if sharding_text is not None:
        local_shape = Sharding.parse(sharding_text, len(shape)).shard_shape(shape)
        return bridge.call_sharded(sampling_kernels.sample, sharding_text, [key_data], [(None,)],
                                   [tuple(range(len(shape)))], noise_shape=shape, shape=local_shape, **options)
    if global_shape is not None:
        return sharding.call_on_block(sampling_kernels.sample, key_data, global_shape=global_shape,
                                      global_offset=global_offset, shape=shape, **options)
    return bridge.call(sampling_kernels.sample, key_data, shape=shape, **options)


sample_op = torch.library.custom_op("torch_pallas::sample", _compute_sample, mutates_args=())
_sample = _autograd.direct(sample_op, _compute_sample)


def sample(key_data: torch.Tensor, shape: Sequence[int], *, distribution: str, dtype: torch.dtype, p: float,
           impl: str, sharding_text: Optional[str] = None, global_shape: Optional[Sequence[int]] = None,
           global_offset: int = 0) -> torch.Tensor:
    """The op :data:`sample_op` (arguments as :func:`_compute_sample` takes them)."""
    return _sample(key_data, shape, distribution, dtype, p, impl, sharding_text, global_shape, global_offset)


@sample_op.register_fake
def _(key_data, shape, distribution, dtype, *options):
    return key_data.new_empty(tuple(shape), dtype=_output_dtype(distribution, dtype))
