"""Kernels on the shards of SPMD-sharded tensors (torch_xla's ``xr.use_spmd()``).

XLA's partitioner cannot split a Mosaic kernel: given a sharded tensor it would gather the
tensor onto every chip and run the kernel whole on each. So an op whose input is sharded
runs its kernel under manual sharding instead: each device gets its own shard
(``xs.enable_manual_sharding``), the kernel runs on it, and the shards are put back
together as a tensor with the input's sharding (``xs.disable_manual_sharding``), with no
all-gather. A noise kernel also gets, as data, the global flat index of its shard's first
element, so every shard draws the bits of its elements' indices in the whole tensor and
the noise is the unsharded run's, whatever the mesh.

A sharding is carried as torch_xla's own text for it (``"{devices=[4,1]0,1,2,3}"``, what
``torch_xla._XLAC._get_xla_sharding_spec`` returns): a string is what a custom op can take.
This module is the only place that reads or applies one.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Optional, Sequence

import numpy as np
import torch
import torch_xla
import torch_xla.runtime as xr
import torch_xla.distributed.spmd as xs

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

    @classmethod
    def of(cls, tensor: torch.Tensor) -> Optional["Sharding"]:
        """``tensor``'s sharding as torch_xla knows it now: set by ``xs.mark_sharding``, or
        propagated by XLA into a tensor it computed and materialised. ``None`` outside SPMD
        mode, and for a replicated tensor or one whose sharding XLA has not decided yet."""
        if not xr.is_spmd() or tensor.device.type != "xla":
            return None
        return cls.parse(torch_xla._XLAC._get_xla_sharding_spec(tensor), tensor.dim())

    @classmethod
    def from_mesh(cls, mesh: xs.Mesh, partition_spec: Sequence) -> Optional["Sharding"]:
        """The sharding ``xs.mark_sharding(t, mesh, partition_spec)`` gives ``t``."""
        if not isinstance(mesh, xs.Mesh):
            raise TypeError(f"mesh must be a torch_xla.distributed.spmd.Mesh, got {type(mesh).__name__}")
        if not isinstance(partition_spec, (tuple, list)):
            raise TypeError(f"partition_spec must be a tuple, got {type(partition_spec).__name__}")
        # torch_xla's own translation, so the result is exactly what mark_sharding would apply:
        # the mesh permuted to (axes of the split dims in order, the other axes).
        spec = xs.xla_sharding._translate_named_partition_spec(mesh, tuple(partition_spec))
        assignment = xs.xla_sharding._get_tile_assignment(mesh, spec)
        split = iter(assignment.shape)
        tiles = tuple(1 if entry is None else next(split) for entry in spec)
        if all(size == 1 for size in tiles):
            return None
        return cls(tiles, tuple(int(i) for i in assignment.reshape(-1)), math.prod(split))

    def permute(self, order: Sequence[int]) -> "Sharding":
        """The sharding of ``tensor.permute(order)``."""
        ids = np.array(self.device_ids).reshape(self.mesh_shape)
        ids = ids.transpose(tuple(order) + tuple(range(len(order), ids.ndim)))
        return Sharding(tuple(self.tiles[d] for d in order), tuple(int(i) for i in ids.reshape(-1)), self.replicas)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return self.tiles + ((self.replicas,) if self.replicas > 1 else ())

    def mesh(self) -> xs.Mesh:
        """A mesh with one axis per tensor dim (and one for the replicas): axis ``d`` splits dim ``d``."""
        return xs.Mesh(np.array(self.device_ids), self.mesh_shape)

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
        sharding it can follow (two split dims at most besides the first; for the hardware
        PRNG, seeded per tile of the whole tensor's 2-D view, shards of whole tiles). Plain
        Python on tuples, so dynamo traces it.

        Raises:
            ValueError: naming ``name`` and what the kernel cannot follow.
        """
        shard_shape = self.shard_shape(shape, name)
        if impl == prng.HARDWARE:
            elementwise.hardware_view(shard_shape, shape, shared_over_first_dim)
        elif impl is not None:
            elementwise.check_index_dims(shard_shape, shape, shared_over_first_dim)
        return self.text

    def shard_offsets(self, shape: Sequence[int], device: torch.device, shared_over_first_dim: bool = False):
        """int32 tensor of shape :attr:`mesh_shape` + (2,): at each device's place, the high
        and low words of the 64-bit flat index in a tensor of ``shape`` of its shard's first
        element (``shared_over_first_dim``: in ``shape[1:]``), as the kernels read them
        (``[high, low]``, each reinterpreted as uint32). Computed on the device from an
        iota, so it is part of the graph, not a constant: every shard runs the same
        program."""
        local = self.shard_shape(shape)
        position = torch.arange(math.prod(self.mesh_shape), dtype=torch.int64, device=device)
        offsets = torch.zeros_like(position)
        for dim, tiles in enumerate(self.tiles):
            if tiles == 1 or (shared_over_first_dim and dim == 0):
                continue
            index = position // math.prod(self.mesh_shape[dim + 1:]) % tiles
            offsets = offsets + index * (local[dim] * math.prod(shape[dim + 1:]))
        words = torch.stack([offsets >> 32, offsets & 0xFFFFFFFF], dim=-1)
        words = torch.where(words >= 2**31, words - 2**32, words)
        return words.to(torch.int32).reshape(*self.mesh_shape, 2)


def resolve(tensor: Optional[torch.Tensor] = None, mesh=None, partition_spec=None) -> Optional[Sharding]:
    """The sharding a call's kernel runs under: the one ``xs.mark_sharding(t, mesh,
    partition_spec)`` gives ``t`` when they are given, else ``tensor``'s own (``None``: the
    kernel runs on the whole tensor, outside SPMD mode and for a replicated tensor).

    Read in eager mode only: under ``torch.compile`` dynamo traces fake tensors, which carry
    no sharding, and cannot trace torch_xla's mesh code (a graph break here gave wrong values
    when sharded results crossed from one graph to the next), so the kernel runs on the whole
    tensor (right values; XLA partitions it; the README says what that means). Modules
    resolve theirs when they are built, and run per shard compiled too.

    Raises:
        TypeError: a ``mesh`` that is not an ``xs.Mesh``, a ``partition_spec`` that is not a tuple.
        ValueError: one of ``mesh`` and ``partition_spec`` without the other, or SPMD mode off.
    """
    if torch.compiler.is_compiling():
        return None
    if mesh is None and partition_spec is None:
        return None if tensor is None else Sharding.of(tensor)
    if mesh is None or partition_spec is None:
        raise ValueError("mesh and partition_spec go together: give both (as to xs.mark_sharding) or neither")
    if not xr.is_spmd():
        raise ValueError("mesh and partition_spec need SPMD mode: call torch_xla.runtime.use_spmd() first")
    return Sharding.from_mesh(mesh, partition_spec)


# Every call of an op on a sharded tensor needs these; computed once per sharding (and one
# Mesh object per sharding keeps torch_xla's own per-mesh cache of OpShardings warm).
@functools.lru_cache(maxsize=None)
def _parsed(sharding_text: str) -> tuple[Sharding, xs.Mesh]:
    sharding = Sharding.parse(sharding_text)
    return sharding, sharding.mesh()


@functools.lru_cache(maxsize=None)
def _text_of_dims(sharding_text: str, dims: tuple) -> str:
    """torch_xla's text for a tensor split as ``dims`` say over ``sharding_text``'s mesh."""
    wanted = Sharding.from_mesh(_parsed(sharding_text)[1], dims)
    return "{replicated}" if wanted is None else wanted.text


def _enter(tensor: torch.Tensor, dims: tuple, sharding_text: str) -> torch.Tensor:
    """Each device's shard of ``tensor`` split as ``dims`` say, in manual sharding mode.

    ``xs.enable_manual_sharding`` marks the tensor it is given; unless the tensor is already
    sharded so, that is a new value, so that the caller's tensor (a parameter, an initial
    state) keeps its own sharding and XLA moves the data between the two."""
    if torch_xla._XLAC._get_xla_sharding_spec(tensor) != _text_of_dims(sharding_text, dims):
        # Not clone(): torch_xla's clone keeps the sharding annotation (an FSDP-sharded
        # weight's, say), and marking it again then fails.
        tensor = tensor + 0
    return xs.enable_manual_sharding(tensor, dims, mesh=_parsed(sharding_text)[1]).global_tensor


def _with_shard_offset(key_data, shard_offset, *arrays, kernel, **static):
    """``kernel`` on one shard: the offsets tensor arrives as each device's own (1, ..., 1, 2) words."""
    return kernel(key_data, *arrays, shard_offset=shard_offset.reshape(2), **static)


def call(jax_function, sharding_text: str, tensors: Sequence[torch.Tensor], in_dims: Sequence[tuple],
         out_dims: Sequence[tuple], *, noise_shape: Optional[Sequence[int]] = None, **static):
    """``jax_function`` applied to each device's shards of ``tensors``; returns the outputs
    put back together, sharded as ``out_dims`` say, with no all-gather.

    ``in_dims[i][k]`` is the dim of the sharding that dim ``k`` of ``tensors[i]`` follows,
    or ``None`` for a dim every device holds whole (likewise ``out_dims`` for the outputs).
    With ``noise_shape`` the function is a noise kernel whose first argument is key data
    (replicated): it gets ``global_shape=noise_shape`` and, as data, its shard's offset in
    that shape (``shared_over_first_dim`` in ``static``: in ``noise_shape[1:]``).
    """
    sharding, mesh = _parsed(sharding_text)
    local = [_enter(tensor, tuple(dims), sharding_text) for tensor, dims in zip(tensors, in_dims)]
    if noise_shape is not None:
        key_data, *rest = local
        offsets = sharding.shard_offsets(noise_shape, key_data.device, static.get("shared_over_first_dim", False))
        offsets = _enter(offsets, (*range(len(sharding.mesh_shape)), None), sharding_text)
        local = [key_data, offsets, *rest]
        static = dict(static, kernel=jax_function, global_shape=tuple(noise_shape))
        jax_function = _with_shard_offset
    outputs = bridge.call(jax_function, *local, **static)
    single = isinstance(outputs, torch.Tensor)
    outputs = (outputs,) if single else tuple(outputs)
    full = []
    for output, dims in zip(outputs, out_dims):
        shape = tuple(size * (1 if d is None else sharding.tiles[d]) for size, d in zip(output.shape, dims))
        full.append(xs.disable_manual_sharding(output, tuple(dims), shape, mesh=mesh).global_tensor)
    return full[0] if single else tuple(full)


def sum_rows_in_order(rows: torch.Tensor, sharding_text: str, dims: tuple, like: torch.Tensor) -> torch.Tensor:
    """The sum over dim 0 of ``rows``, split as ``dims`` say, in a fixed order, sharded as
    ``like`` (a parameter whose gradient this is: replicated unless it is sharded).

    The rows are first gathered onto every device (an all-gather of this small tensor only)
    and summed there, so the result does not depend on a cross-device reduction's order."""
    mesh = _parsed(sharding_text)[1]
    gathered = xs.mark_sharding(rows.clone(), mesh, (None, *dims[1:])).global_tensor
    total = gathered.sum(0)
    target = Sharding.of(like)
    if target is None:
        return xs.mark_sharding(total, mesh, (None,) * total.dim()).global_tensor
    return xs.mark_sharding(total, _parsed(target.text)[1], tuple(range(total.dim()))).global_tensor
