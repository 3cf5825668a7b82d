"""Noise ops on ``torch.distributed`` DTensors: each rank runs the kernel on its local shard,
which draws that shard's part of the whole tensor's noise, with no communication. So a
DTensor's masks are those of the unsharded call for the same key, whatever the mesh and the
placements (``Shard`` on any dim, with torch's uneven shards; ``Replicate``; ``Partial``,
through which dropout passes: the dropout of a sum of partial tensors is the sum of their
dropouts under one mask), and the outputs keep the input's placements.

How a shard draws its part:

* ``impl="threefry"`` draws per element of the whole tensor's flat index: the kernel takes any
  block split along at most two dims besides the first, with its offset in the whole tensor.
* The per-tile impls (``"tiled"``, ``"hardware"``) draw per tile of the whole tensor's 2-D view
  (:func:`torch_pallas.kernels.elementwise.per_tile_view`). The kernel layer draws any shard's
  part of it, as it does torch_xla's SPMD shards: a shard that is not whole bands of tiles is
  drawn in the bands that cover it and cut out (:func:`torch_pallas.kernels.elementwise.noise_map`).

The key is drawn on each rank as for a plain tensor (a ``seed``, a ``generator``, or the RNG of
the shard's device), so ranks must draw alike: seeded alike, as torch's own DTensor random ops
also require (:ref:`DTensors <dtensors>`).

Tested with real processes on torch 2.9 and 2.14 (``tests/distributed``).
"""

from __future__ import annotations

import itertools
import math
from typing import Callable, Sequence

import torch

from torch_pallas import bridge
from torch_pallas.kernels import elementwise, prng
from torch_pallas.sharding import check_noise_block

# At module level, not in the functions: dynamo cannot trace an import (fullgraph=True).
if torch.distributed.is_available():
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

__all__ = ["check_layout", "check_placements", "flat_offset", "linear_of_shards", "linear_placements", "local_block",
           "map_channels", "map_noise_blocks", "on_local_shards", "placed_rows", "placements_match", "replicated",
           "row_runs", "rows_and_vocabulary", "sample_on_mesh", "shardwise"]


def check_placements(x, name: str = "x") -> None:
    """Raises ValueError for a DTensor placement the noise ops cannot follow: anything but
    ``Shard``, ``Replicate`` and ``Partial`` (``_StridedShard``, the interleaved shards FSDP2
    gives tensor-parallel parameters, is not a block of the whole tensor)."""
    for placement in x.placements:
        if type(placement) not in (Shard, Replicate, Partial):
            raise ValueError(f"{name} is a DTensor placed {placement} on its mesh; torch_pallas's noise ops take "
                             f"Shard, Replicate and Partial placements: redistribute it to those first "
                             f"({name}.redistribute(mesh, placements))")


def _local_block(x) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """DTensor ``x``'s :func:`local_block`."""
    return local_block(tuple(x.shape), x.device_mesh, x.placements)


def local_block(global_shape: Sequence[int], mesh, placements) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's shard's shape and its offset along each dim of a tensor of ``global_shape``
    placed on ``mesh`` as ``placements``: each ``Shard`` placement, in mesh-dim order, splits
    what the earlier ones left as ``torch.chunk`` does (chunks of ``ceil(size / ranks)``, the
    last ones shorter or empty), as DTensor places shards. Plain arithmetic on the mesh
    coordinate, so it also runs on fake tensors."""
    return _block_at(global_shape, mesh, placements, mesh.get_coordinate())


def _block_at(global_shape: Sequence[int], mesh, placements, coordinate) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """:func:`local_block` of the rank at ``coordinate`` of ``mesh``."""
    shape, offset = list(global_shape), [0] * len(global_shape)
    for mesh_dim, (placement, index) in enumerate(zip(placements, coordinate)):
        if isinstance(placement, Shard):
            dim = placement.dim % len(shape)
            chunk = -(-shape[dim] // mesh.size(mesh_dim))
            start = min(index * chunk, shape[dim])
            offset[dim] += start
            shape[dim] = min(chunk, shape[dim] - start)
    return tuple(shape), tuple(offset)


def flat_offset(offset: Sequence[int], shape: Sequence[int], shared_over_first_dim: bool = False) -> int:
    """The flat index, in the noise of a tensor of ``shape``, of the element at ``offset``
    (``shared_over_first_dim``: in the noise of ``shape[1:]``)."""
    first = 1 if shared_over_first_dim else 0
    return sum(index * math.prod(shape[d + 1:]) for d, index in enumerate(offset) if d >= first)


def _runs(shape: Sequence[int], local_shape: Sequence[int], offset: Sequence[int]) -> tuple[int, list[int]]:
    """The runs of the block of ``local_shape`` at ``offset`` of a tensor of ``shape``, in its
    flat order: (their length, the flat index of each start;
    :func:`torch_pallas.kernels.elementwise.block_runs`)."""
    length, starts = elementwise.block_runs(local_shape, shape)
    first = flat_offset(offset, shape)
    return length, [first + start for start in starts]


def row_runs(x) -> list[tuple[int, list[int]]] | None:
    """This rank's block of DTensor ``x`` as runs of the ``(M, K)`` rows of ``x`` (``K`` its last
    dim): (rows per run, each run's first row); ``None`` where some rank's block splits the
    last dim or has more than :data:`torch_pallas.kernels.elementwise.MOST_RUNS` runs (each a kernel call)."""
    shape = tuple(x.shape)
    if not shape:
        return None
    mesh = x.device_mesh
    own = tuple(mesh.get_coordinate())
    everyone = itertools.product(*[range(mesh.size(dim)) for dim in range(mesh.ndim)])
    for coordinate in [own, *(c for c in everyone if c != own)]:
        block_shape, offset = _block_at(shape, mesh, x.placements, coordinate)
        length, starts = _runs(shape, block_shape, offset)
        if block_shape[-1] != shape[-1] or len(starts) > elementwise.MOST_RUNS:
            return None
        if coordinate == own:
            runs = length // shape[-1], [start // shape[-1] for start in starts]
    return runs


def linear_placements(x, weight) -> tuple | None:
    """The placements of ``F.linear(x, weight)`` of DTensors when each rank computes its block
    from its own shards, with no communication: per mesh dim, both replicated; ``x`` split
    along a dim but its last (rows) and ``weight`` replicated; or ``x`` replicated and
    ``weight`` split along its rows (output features: tensor parallelism's column shards).
    ``None`` for any other pair."""
    if not (bridge.is_dtensor(weight) and weight.device_mesh == x.device_mesh and weight.dim() == 2 and x.dim() >= 1):
        return None
    placements = []
    for own, other in zip(x.placements, weight.placements):
        if isinstance(own, Replicate) and isinstance(other, Replicate):
            placements.append(Replicate())
        elif type(own) is Shard and own.dim % x.dim() != x.dim() - 1 and isinstance(other, Replicate):
            placements.append(Shard(own.dim % x.dim()))
        elif isinstance(own, Replicate) and type(other) is Shard and other.dim % 2 == 0:
            placements.append(Shard(x.dim() - 1))
        else:
            return None
    return tuple(placements)


def replicated(tensor: torch.Tensor, like):
    """``tensor``, a DTensor as it is, or a plain one as a DTensor replicated on DTensor
    ``like``'s mesh (a module's parameter; its gradient is the one summed over the ranks)."""
    if bridge.is_dtensor(tensor):
        return tensor
    return DTensor.from_local(tensor, like.device_mesh, [Replicate()] * like.device_mesh.ndim, run_check=False)


def linear_of_shards(x, weight, bias=None):
    """``F.linear(x, weight, bias)`` of DTensor ``x`` split along any dims but its last (or
    replicated), with a replicated ``weight`` (and ``bias``): each rank's rows from its own
    shard, placed as ``x`` (torch's DTensor linear cannot flatten a split dim other than the
    first). The weight's gradient is summed over the ranks.

    Raises:
        ValueError: ``x`` split along its last dim or ``Partial``, or a ``weight`` or ``bias``
            that is not replicated on ``x``'s mesh.
    """
    operands = [weight] + ([] if bias is None else [bias])
    placements = linear_placements(x, weight)
    if (placements is None or tuple(placements) != tuple(x.placements)
            or any(not all(isinstance(p, Replicate) for p in t.placements) for t in operands)):
        raise ValueError(f"a linear layer of DTensors here takes an input split along any dims but its last (got "
                         f"{x.placements}) and a weight and bias replicated on its mesh (got "
                         f"{[t.placements for t in operands]})")
    return on_local_shards(lambda x, *operands: torch.nn.functional.linear(x, *operands), x.device_mesh, placements,
                           [(placements, (*x.shape[:-1], weight.shape[0]))], x, *operands)


class _Shardwise(torch.autograd.Function):
    """A map of DTensors computed shard by shard, linear in ``x`` (plus ``residual``): its
    gradient is ``adjoint`` of the output's, and the output's itself for ``residual``. Autograd
    does not go through ``to_local`` and ``from_local``: with uneven shards their backward gives
    the local gradient a stride of even ones, and the gradient comes back all-gathered
    (``Replicate``) when it reaches ``x`` (torch 2.9 to 2.14)."""

    @staticmethod
    def forward(ctx, x, residual, forward, adjoint):
        ctx.adjoint, ctx.mesh, ctx.placements = adjoint, x.device_mesh, x.placements
        ctx.residual_placements = None if residual is None else residual.placements
        return forward(x, residual)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        if grad.placements != ctx.placements:
            grad = grad.redistribute(ctx.mesh, ctx.placements)
        grad_residual = None
        if ctx.residual_placements is not None:
            # A new DTensor: handed the incoming one, which autograd holds too, AccumulateGrad
            # would copy it into new_empty_strided's DTensor, which is Replicate (all-gathered).
            grad_residual = _like(grad.redistribute(ctx.mesh, ctx.residual_placements).to_local().clone(), grad)
        return ctx.adjoint(grad), grad_residual, None, None


def _like(local: torch.Tensor, x):
    """The DTensor of shard ``local`` placed as ``x``, with ``x``'s global shape and stride."""
    return DTensor.from_local(local, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride())


class _LocalShard(torch.autograd.Function):
    """DTensor ``x``'s local shard, for a rank's own computation on it: its gradient is the
    local one, placed as ``x`` (summed over the ranks, for an ``x`` replicated on a mesh dim
    that splits the work). Not ``to_local``, whose backward gives an uneven shard's gradient a
    stride of even ones, so that it comes back all-gathered (``Replicate``) when it reaches
    ``x`` (torch 2.9 to 2.14)."""

    @staticmethod
    def forward(ctx, x, work_placements):
        ctx.mesh, ctx.placements, ctx.shape = x.device_mesh, tuple(x.placements), tuple(x.shape)
        # A replicated input read by sharded work: each rank's gradient is its part of the sum.
        ctx.summed = tuple(Partial() if isinstance(own, Replicate) and isinstance(other, Shard) else own
                           for own, other in zip(x.placements, work_placements))
        return x.to_local().view_as(x.to_local())

    @staticmethod
    def backward(ctx, grad):
        placed = _placed(grad, ctx.mesh, ctx.summed, ctx.shape)
        return (placed if ctx.summed == ctx.placements else placed.redistribute(ctx.mesh, ctx.placements)), None


class _Placed(torch.autograd.Function):
    """The DTensor of shard ``local`` of a contiguous tensor of ``shape``, placed on ``mesh``:
    its gradient is the incoming one's shard in those placements (see :class:`_LocalShard`)."""

    @staticmethod
    def forward(ctx, local, mesh, placements, shape):
        ctx.mesh, ctx.placements = mesh, placements
        return _placed(local, mesh, placements, shape)

    @staticmethod
    def backward(ctx, grad):
        if tuple(grad.placements) != tuple(ctx.placements):
            grad = grad.redistribute(ctx.mesh, ctx.placements)
        return grad.to_local(), None, None, None


def _placed(local: torch.Tensor, mesh, placements, shape):
    """The DTensor of shard ``local`` of a contiguous tensor of ``shape``."""
    strides = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
    return DTensor.from_local(local, mesh, tuple(placements), run_check=False, shape=torch.Size(shape), stride=strides)


def on_local_shards(function: Callable, mesh, work_placements, outputs: Sequence, *inputs):
    """``function(*local shards of inputs)``: a local tensor, or a tuple of them, each placed on
    ``mesh`` as ``outputs`` say (``(placements, global shape)`` each), differentiable: each rank
    differentiates its local computation. ``work_placements`` say which mesh dims split the work
    (``Shard``): an input replicated on such a dim gets the sum of the ranks' gradients."""
    outputs = [(tuple(placements), tuple(shape)) for placements, shape in outputs]
    work_placements = tuple(work_placements)
    if torch.is_grad_enabled() and any(tensor.requires_grad for tensor in inputs):
        results, place = function(*(_LocalShard.apply(tensor, work_placements) for tensor in inputs)), _Placed.apply
    else:  # (no autograd Function without a gradient: dynamo 2.9 traces their apply without its ctx there)
        results, place = function(*(tensor.to_local() for tensor in inputs)), _placed
    placed = tuple(place(result, mesh, placements, shape)
                   for result, (placements, shape) in zip(results if isinstance(results, tuple) else (results,),
                                                          outputs))
    return placed if isinstance(results, tuple) else placed[0]


def shardwise(x, residual, forward: Callable, adjoint: Callable):
    """``forward(x, residual)`` (``residual`` a DTensor or ``None``), a DTensor computed from the
    local shards (:func:`map_noise_blocks`, :func:`map_channels`) and linear in ``x``,
    differentiable: ``x``'s gradient is ``adjoint(grad)``, ``residual``'s ``grad``."""
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, residual))):
        return forward(x, residual)  # (as on_local_shards: no autograd Function without a gradient)
    return _Shardwise.apply(x, residual, forward, adjoint)


def map_noise_blocks(x, others: Sequence, block_op: Callable, *, impl: str, shared_over_first_dim: bool = False,
                     name: str = "x"):
    """``block_op(local, *other_locals, global_shape=..., global_offset=...)`` on the blocks of
    DTensor ``x``'s local shard (and of ``others``, DTensors placed as ``x``) that its kernel
    can draw (see the module's docstring), put together into a DTensor placed as ``x``.
    ``block_op`` is a noise op of elementwise blocks: its output has its first argument's
    shape, and a zero input gives a zero output.

    Raises:
        ValueError: a placement :func:`check_placements` refuses, or a shard the kernel cannot
            draw its part of, naming ``impl="threefry"``.
    """
    check_placements(x, name)
    shape = tuple(x.shape)
    local_shape, offset = _local_block(x)
    locals_ = [x.to_local(), *(other.to_local() for other in others)]
    if math.prod(local_shape) == 0:  # an empty shard (more ranks than rows): nothing to draw
        return _like(block_op(*locals_, global_shape=shape, global_offset=0), x)
    check_noise_block(local_shape, shape, impl, shared_over_first_dim)
    if prng.per_tile(impl):
        _check_starts_where_the_kernel_takes_it(local_shape, shape, offset, impl, shared_over_first_dim)
    global_offset = flat_offset(offset, shape, shared_over_first_dim)
    return _like(block_op(*locals_, global_shape=shape, global_offset=global_offset), x)


def _check_starts_where_the_kernel_takes_it(local_shape, shape, offset, impl: str, shared_over_first_dim: bool) -> None:
    """Raises ValueError for a shard the kernel layer would take to start at a band of the per-tile
    impls' tiles (:func:`torch_pallas.kernels.elementwise.draws_whole_bands`: whole bands, of an
    even split's shape, as such shards start) that does not, as a block of an uneven split of one
    dim over two mesh dims can. Checked in the view the kernel draws (the swapped tensor's, where it
    is seen swapped)."""
    view, block, start = shape, local_shape, offset
    if elementwise.swaps_first_dims(shape, shared_over_first_dim):
        view, block, start = map(elementwise.swap_first_dims, (shape, local_shape, offset))
    if (elementwise.draws_whole_bands(block, view, shared_over_first_dim)
            and flat_offset(start, view, shared_over_first_dim) % elementwise.band_length(view, shared_over_first_dim)):
        raise ValueError(f'impl="{impl}" on a DTensor shard of shape {tuple(local_shape)} at {tuple(offset)} of a tensor '
                         f"of shape {tuple(shape)}: the kernel takes a shard of this shape to start at a band of its "
                         f"tiles, and this one (of an uneven split, as of one dim over two mesh dims) does not; use "
                         f'impl="threefry" (drawn per element) or shard it evenly')


def check_layout(mesh, placements) -> tuple:
    """``placements`` as a tuple, checked to be a sample's layout on ``mesh``.

    Raises:
        TypeError: ``mesh`` is not a ``DeviceMesh``.
        ValueError: ``placements`` that are not one ``Shard`` or ``Replicate`` per mesh dim.
    """
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"device_mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
    placements = tuple(placements)
    if len(placements) != mesh.ndim or any(type(placement) not in (Shard, Replicate) for placement in placements):
        raise ValueError(f"placements must be one Shard or Replicate per dim of the {mesh.ndim}-D mesh, got "
                         f"{list(placements)}")
    return placements


def sample_on_mesh(shape: Sequence[int], mesh, placements, sample_block: Callable, *, impl: str):
    """A DTensor of ``shape`` placed on ``mesh`` as ``placements`` (``Shard`` and ``Replicate``),
    each rank holding its block of the whole tensor's numbers: ``sample_block(block_shape,
    global_shape=..., global_offset=...)`` draws a block's (see the module's docstring).

    Raises:
        TypeError: as :func:`check_layout`.
        ValueError: as :func:`check_layout`, and a shard the kernel cannot draw, naming
            ``impl="threefry"``.
    """
    placements = check_layout(mesh, placements)
    local_shape, _ = local_block(shape, mesh, placements)
    # A stand-in of the shard's shape, for map_noise_blocks to cut into the blocks it draws.
    stand_in = torch.zeros(local_shape, dtype=torch.uint8, device=mesh.device_type)
    strides = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
    like = DTensor.from_local(stand_in, mesh, placements, run_check=False, shape=torch.Size(shape), stride=strides)
    return map_noise_blocks(like, (), lambda block, **where: sample_block(tuple(block.shape), **where), impl=impl,
                            name="the sample")


def rows_and_vocabulary(logits) -> tuple[slice, int, tuple, tuple]:
    """How this rank holds DTensor ``logits`` ``(B, V)``, placed ``Shard(0)`` (the batch),
    ``Shard(1)`` or ``Shard(-1)`` (the vocabulary: a tensor-parallel ``lm_head``'s) and
    ``Replicate`` on its mesh: its block's rows (a slice of the batch), its first column's index
    in the vocabulary, the process groups of the mesh dims that split the vocabulary, and the
    placements of a ``(B,)`` result (``Shard(0)`` where the rows are split, else ``Replicate``).

    Raises:
        ValueError: a ``Partial`` or another placement (the logits must be summed first), or a
            split that leaves some rank no columns (raised on every rank alike, before any
            collective).
    """
    mesh, placements, shape = logits.device_mesh, tuple(logits.placements), tuple(logits.shape)
    for placement in placements:
        if type(placement) not in (Shard, Replicate):
            raise ValueError(f"logits is a DTensor placed {placement} on its mesh; sample_tokens takes Shard(0), "
                             f"Shard(-1) and Replicate placements: redistribute it first "
                             f"(logits.redistribute(mesh, placements), a Partial sum to Replicate())")
    everyone = itertools.product(*[range(mesh.size(dim)) for dim in range(mesh.ndim)])
    if any(_block_at(shape, mesh, placements, coordinate)[0][1] == 0 for coordinate in everyone):
        raise ValueError(f"logits of shape {shape} placed {placements} leave some rank no vocabulary columns; "
                         f"split the vocabulary over fewer ranks")
    block, offset = local_block(shape, mesh, placements)
    splits = [isinstance(placement, Shard) and placement.dim % 2 == dim for placement in placements
              for dim in (0, 1)]
    groups = tuple(mesh.get_group(mesh_dim) for mesh_dim in range(mesh.ndim) if splits[2 * mesh_dim + 1])
    rows = tuple(Shard(0) if splits[2 * mesh_dim] else Replicate() for mesh_dim in range(mesh.ndim))
    return slice(offset[0], offset[0] + block[0]), offset[1], groups, rows


def placed_rows(local: torch.Tensor, logits, placements) -> torch.Tensor:
    """The ``(B,)`` DTensor of this rank's rows ``local`` of a result for DTensor ``logits``
    (``placements``: :func:`rows_and_vocabulary`'s)."""
    return _placed(local, logits.device_mesh, placements, (logits.shape[0],))


def map_channels(x, scale: torch.Tensor):
    """``x * scale`` for DTensor ``x`` and a plain ``scale`` of ``x``'s leading dims (a channel
    dropout's mask, drawn whole): each rank scales its shard by its block of ``scale``."""
    check_placements(x)
    local_shape, offset = _local_block(x)
    block = scale[tuple(slice(start, start + size) for start, size in zip(offset[:scale.dim()], local_shape))]
    output = x.to_local() * block.reshape(*block.shape, *[1] * (x.dim() - scale.dim()))
    return _like(output, x)


def placements_match(x, other) -> bool:
    """Whether DTensor ``other`` has ``x``'s mesh and placements, none of them ``Partial``: then
    an elementwise kernel of both runs on their local shards."""
    return (bridge.is_dtensor(other) and other.device_mesh == x.device_mesh and other.placements == x.placements
            and not any(isinstance(placement, Partial) for placement in x.placements))

