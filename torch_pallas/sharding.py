"""Kernels on the shards of sharded tensors (torch_xla's SPMD mode; torchax tensors over a
JAX mesh).

XLA's partitioner cannot split a Mosaic kernel: given a sharded tensor it would gather the
tensor onto every chip and run the kernel whole on each. So an op whose input is sharded
runs its kernel on each device's shard instead (how is its front end's business:
:mod:`torch_pallas.frontends`), and the outputs are put back together with the input's
sharding, with no all-gather. A noise kernel also gets, as data, the global flat index of
its shard's first element, so every shard draws the bits of its elements' indices in the
whole tensor and the noise is the unsharded run's, whatever the mesh.

A sharding is carried as XLA's text for it (``"{devices=[4,1]0,1,2,3}"``, what torch_xla's
``_get_xla_sharding_spec`` returns and JAX's ``HloSharding`` prints): a string is what a
custom op can take. This module is the front-end-neutral part: what a sharding is, whether
a kernel can follow it, and which sharding a call runs under; the front ends run the calls
(:func:`torch_pallas.bridge.call_sharded`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Optional, Sequence

import numpy as np
import torch

from torch_pallas import bridge
from torch_pallas.kernels import elementwise, prng

_TILED = re.compile(r"\{devices=\[([\d,]+)\]([\d,]+)( last_tile_dim_replicate)?\}")


@dataclasses.dataclass(frozen=True)
class Sharding:
    """How a tensor is split: ``tiles[d]`` shards along dim ``d``, each held by ``replicas``
    devices; ``device_ids`` lists the devices row-major over ``tiles + (replicas,)``."""
    tiles: tuple[int, ...]
    device_ids: tuple[int, ...]
    replicas: int = 1
    text: str = dataclasses.field(init=False, compare=False)  # torch_xla's text for it

    def __post_init__(self):
        suffix = " last_tile_dim_replicate" if self.replicas > 1 else ""
        object.__setattr__(self, "text", f"{{devices=[{','.join(map(str, self.mesh_shape))}]"
                                         f"{','.join(map(str, self.device_ids))}{suffix}}}")

    @classmethod
    def parse(cls, text: str, rank: Optional[int] = None) -> Optional["Sharding"]:
        """The sharding torch_xla's ``text`` describes (for a tensor of ``rank`` dims, when
        given); ``None`` for none or a replicated one.

        Raises:
            ValueError: a sharding the kernels cannot run on (maximal, manual, or another
                form), named with the text.
        """
        if text in ("", "{replicated}"):
            return None
        match = _TILED.fullmatch(text)
        if match is None:
            raise ValueError(f"torch_pallas runs on tensors that are tiled over a mesh (xs.mark_sharding) or "
                             f"replicated; this tensor's sharding is {text}")
        tiles = tuple(int(size) for size in match[1].split(","))
        replicas = 1
        if match[3]:
            *tiles, replicas = tiles
        if rank is not None and len(tiles) != rank:
            raise ValueError(f"sharding {text} does not describe a tensor of {rank} dims")
        if all(size == 1 for size in tiles):
            return None
        return cls(tuple(tiles), tuple(int(i) for i in match[2].split(",")), replicas)

    def permute(self, order: Sequence[int]) -> "Sharding":
        """The sharding of ``tensor.permute(order)``."""
        ids = np.array(self.device_ids).reshape(self.mesh_shape)
        ids = ids.transpose(tuple(order) + tuple(range(len(order), ids.ndim)))
        return Sharding(tuple(self.tiles[d] for d in order), tuple(int(i) for i in ids.reshape(-1)), self.replicas)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The devices' grid: ``tiles``, and ``replicas`` as a last dim when there are several."""
        return self.tiles + ((self.replicas,) if self.replicas > 1 else ())

    def shard_shape(self, shape: Sequence[int], name: str = "the tensor") -> tuple[int, ...]:
        """Each device's shard of a tensor of ``shape``.

        Raises:
            ValueError: a rank other than the sharding's, or a dim that does not split
                evenly (XLA would pad its last shards, and a kernel cannot tell padding
                from data).
        """
        if len(shape) != len(self.tiles):
            raise ValueError(f"{name} of shape {tuple(shape)} has {len(shape)} dims, but its sharding splits "
                             f"{len(self.tiles)} dims ({self.text}): give a partition_spec with one entry per dim")
        for dim, (size, tiles) in enumerate(zip(shape, self.tiles)):
            if size % tiles:
                raise ValueError(f"{name} of shape {tuple(shape)} is split into {tiles} shards along dim {dim}, "
                                 f"which does not divide {size}; torch_pallas needs equal shards")
        return tuple(size // tiles for size, tiles in zip(shape, self.tiles))

    def check(self, shape: Sequence[int], name: str, impl: Optional[str] = None,
              shared_over_first_dim: bool = False) -> str:
        """Returns :attr:`text` if a tensor of ``shape`` can be processed per shard: equal
        shards (:meth:`shard_shape`), and for a noise kernel of ``impl`` (not ``None``) a
        sharding it can follow (two split dims at most besides the first; for the per-tile
        impls, drawn per tile of the whole tensor's 2-D view, shards of whole tiles). Plain
        Python on tuples, so dynamo traces it.

        Raises:
            ValueError: naming ``name`` and what the kernel cannot follow.
        """
        shard_shape = self.shard_shape(shape, name)
        if impl is not None:
            check_noise_block(shard_shape, shape, impl, shared_over_first_dim)
        return self.text

    def shard_offset_words(self, shape: Sequence[int], shared_over_first_dim: bool = False) -> np.ndarray:
        """int32 array of shape :attr:`mesh_shape` + (2,): at each device's place, the high
        and low words of the 64-bit flat index in a tensor of ``shape`` of its shard's first
        element (``shared_over_first_dim``: in ``shape[1:]``), as the kernels read them
        (``[high, low]``, each reinterpreted as uint32)."""
        local = self.shard_shape(shape)
        offsets = np.zeros(self.mesh_shape, dtype=np.uint64)
        for dim, tiles in enumerate(self.tiles):
            if tiles == 1 or (shared_over_first_dim and dim == 0):
                continue
            along = [tiles if d == dim else 1 for d in range(len(self.mesh_shape))]
            index = np.arange(tiles, dtype=np.uint64).reshape(along)
            offsets = offsets + index * np.uint64(local[dim] * math.prod(shape[dim + 1:]))
        words = np.stack([offsets >> np.uint64(32), offsets & np.uint64(0xFFFFFFFF)], axis=-1)
        return words.astype(np.uint32).view(np.int32)


def check_noise_block(block_shape: Sequence[int], shape: Sequence[int], impl: str,
                      shared_over_first_dim: bool = False) -> None:
    """Raises ValueError unless a noise kernel of ``impl`` can draw, for a block of
    ``block_shape`` of a tensor of ``shape``, that block's part of the whole tensor's noise:
    threefry's, a block split along at most two dims besides the first
    (:func:`elementwise.check_index_dims`). The per-tile impls draw any block (one that is
    not whole bands of their tiles in the bands that cover it: :func:`elementwise.noise_map`)."""
    if not prng.per_tile(impl):
        elementwise.check_index_dims(block_shape, shape, shared_over_first_dim)


def offset_words(flat_offset: int) -> list[int]:
    """The high and low words of the 64-bit flat index ``flat_offset``, each as a signed int32,
    as the kernels read a block's offset (see :meth:`Sharding.shard_offset_words`)."""
    return np.array([flat_offset >> 32, flat_offset & 0xFFFFFFFF], dtype=np.uint32).view(np.int32).tolist()


def call_on_block(kernel, key_data: torch.Tensor, *arrays: torch.Tensor, global_shape: Sequence[int],
                  global_offset: int, **static):
    """Noise ``kernel`` on ``arrays``, a block of a tensor of ``global_shape`` whose first element
    is at flat index ``global_offset`` there (a DTensor's local shard, or a part of one): it
    draws that block's part of the whole tensor's noise, on key_data's device."""
    words = torch.tensor(offset_words(global_offset), dtype=torch.int32, device=key_data.device)
    return bridge.call(with_shard_offset, key_data, words, *arrays, kernel=kernel, global_shape=tuple(global_shape),
                       **static)


def with_shard_offset(key_data, shard_offset, *arrays, kernel, **static):
    """``kernel`` on one shard, as a front end runs it per device: the offsets (the front end
    splits :meth:`Sharding.shard_offset_words` over the mesh) arrive as each device's own
    (1, ..., 1, 2) words."""
    return kernel(key_data, *arrays, shard_offset=shard_offset.reshape(2), **static)


def resolve(tensor: Optional[torch.Tensor] = None, mesh=None, partition_spec=None) -> Optional[Sharding]:
    """The sharding a call's kernel runs under: the one ``mesh`` and ``partition_spec`` give a
    tensor (as ``xs.mark_sharding(t, mesh, partition_spec)`` or a JAX ``NamedSharding(mesh,
    PartitionSpec(*partition_spec))`` does) when they are given, else ``tensor``'s own
    (``None``: the kernel runs on the whole tensor: unsharded, replicated).

    Read in eager mode only: under ``torch.compile`` dynamo traces fake tensors, which carry
    no sharding, and cannot trace torch_xla's mesh code (a graph break here gave wrong values
    when sharded results crossed from one graph to the next), and inside a JAX trace a
    torchax tensor holds a tracer; the kernel then runs on the whole tensor (right values;
    XLA partitions it: :ref:`sharded tensors <sharding-limits>` says what that means). Modules resolve theirs when they
    are built, and run per shard compiled too.

    Raises:
        TypeError: a ``mesh`` of another type than the stack's, a ``partition_spec`` that is
            not a tuple.
        ValueError: one of ``mesh`` and ``partition_spec`` without the other, or (torch_xla)
            SPMD mode off.
    """
    if torch.compiler.is_compiling():
        return None
    if mesh is None and partition_spec is None:
        return None if tensor is None else bridge.sharding_of(tensor)
    if mesh is None or partition_spec is None:
        raise ValueError("mesh and partition_spec go together: give both (as to xs.mark_sharding) or neither")
    if not isinstance(partition_spec, (tuple, list)):
        raise TypeError(f"partition_spec must be a tuple, got {type(partition_spec).__name__}")
    return bridge.sharding_from_mesh(mesh, partition_spec)
