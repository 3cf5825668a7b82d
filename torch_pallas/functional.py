"""The public differentiable functions: :func:`dropout`, its channel variants :func:`dropout1d`,
:func:`dropout2d`, :func:`dropout3d`, and :func:`indrnn`."""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from torch_pallas import _checks, bridge, dtensors, seeds, sharding
from torch_pallas.kernels.indrnn import check_nonlinearity
from torch_pallas.kernels import dropout_linear as dropout_linear_kernels, prng
from torch_pallas.kernels.dropout_matmul import check_shapes as check_matmul_shapes
from torch_pallas.sharding import Sharding
from torch_pallas.ops import (dropout as dropout_ops, dropout_linear as dropout_linear_ops,
                              dropout_matmul as dropout_matmul_ops, indrnn as indrnn_ops)

__all__ = ["dropout", "dropout_add", "dropout_linear", "dropout_matmul", "dropout1d", "dropout2d", "dropout3d",
           "indrnn"]


def dropout(x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False, *, seed=None,
            generator=None, impl=None, shared_over_first_dim: bool = False, mesh=None,
            partition_spec=None) -> torch.Tensor:
    r"""Dropout of ``x``: what :class:`torch_pallas.nn.Dropout` computes (see there), as a
    function with the key's source chosen per call, as :func:`torch.nn.functional.dropout` is
    to :class:`torch.nn.Dropout`.

    Args:
        x (Tensor): the input, as :class:`~torch_pallas.nn.Dropout`'s (any tensor when nothing
            is dropped: ``training=False`` or ``p == 0``).
        p, inplace, impl: as :class:`~torch_pallas.nn.Dropout` takes them.
        training (bool): apply dropout if ``True``; return ``x`` itself if ``False``, for
            any device and dtype (the other arguments are checked either way).
        seed (int, optional): in :math:`[0, 2^{64})`; the same seed gives the same mask.
        generator (torch.Generator, optional): a CPU generator (with TorchTPU also a
            ``tpu`` one) to draw the key from. With neither, a fresh key per call from the
            RNG of ``x``'s device (:ref:`where keys come from <key-sources>`).
        shared_over_first_dim (bool): draw one mask of shape ``x.shape[1:]`` and apply it
            at every index of the first dim (for a recurrent net's time-major sequence:
            the same mask at every time step). Default: ``False``.
        mesh, partition_spec: as :class:`~torch_pallas.nn.Dropout` takes them, but read in
            eager mode only, and by default the sharding ``x`` carries (an intermediate
            activation has none yet): under ``torch.compile`` the kernel runs on the whole
            tensor (same values; XLA partitions it). Give them to the module to run per shard
            there.

    Returns:
        Tensor: same shape and dtype as ``x`` (a new tensor unless ``x`` is returned as is
        or ``inplace``).

    Raises:
        TypeError: ``x`` is not a float tensor (integer and bool tensors are rejected), or
            ``p``, ``seed`` or ``generator`` has the wrong type.
        ValueError: as :class:`~torch_pallas.nn.Dropout`, and a seed outside
            :math:`[0, 2^{64})`, both ``seed`` and ``generator``, ``x`` on a device
            torch_pallas does not run on, ``shared_over_first_dim`` with a 0-dim ``x``, or a
            sharding of ``x`` the kernel cannot take (:ref:`sharded tensors <sharding-limits>`).

    Example::

        >>> x = torch.randn(4, 128, device=torch_xla.device(), requires_grad=True)
        >>> y = torch_pallas.dropout(x, p=0.1, seed=0)
        >>> y.sum().backward()   # the same mask, regenerated from the key
    """
    _checks.check_tensor(x, "x")
    return dropout_under_sharding(x, p, training, inplace, seed=seed, generator=generator, impl=impl,
                                  shared_over_first_dim=shared_over_first_dim,
                                  sharding=sharding.resolve(x, mesh, partition_spec))


def dropout_under_sharding(x: torch.Tensor, p: float, training: bool, inplace: bool, *, seed=None, generator=None,
                           impl=None, shared_over_first_dim: bool = False,
                           sharding: Optional[Sharding] = None) -> torch.Tensor:
    """:func:`dropout` of a tensor ``x`` whose ``sharding`` is resolved (``None``: the kernel
    runs on the whole tensor): the path of the function and of the modules, which resolve
    theirs when they are built."""
    drawn = draw_dropout(x, p, training, seed, generator, impl, shared_over_first_dim, sharding)
    if drawn is None:
        return x  # the identity, as torch's, for any device and dtype
    output = drawn.output()
    return x.copy_(output) if inplace else output


class DrawnDropout(NamedTuple):
    """A dropout of ``x`` whose key is drawn: what its output, and a residual added to it,
    are computed from. ``key_data`` is ``None`` when ``p == 1`` (no mask to draw).
    ``attention_layout``: ``x`` holds ``(*batch, L, S)`` attention weights whose mask is drawn as
    the attention kernels draw theirs (:func:`draws_attention_layout`), so that their product
    with a value may run fused with this very mask."""

    x: torch.Tensor
    key_data: torch.Tensor | None
    p: float
    impl: str
    shared_over_first_dim: bool
    sharding_text: str | None
    attention_layout: bool = False

    def output(self) -> torch.Tensor:
        if self.key_data is None:
            return self.x * 0  # as torch's: NaN and infinities give NaN, and so do their gradients
        if self.attention_layout:
            return self._on_planes(lambda weights, **block: dropout_matmul_ops.apply_dropout_weights(
                weights, self.key_data, p=self.p, impl=self.impl, **block), ())
        if bridge.is_dtensor(self.x):
            return dtensors.shardwise(self.x, None, lambda x, _: self._dropout_of_shard(x), self._dropout_of_shard)
        return dropout_ops.apply(self.x, self.key_data, p=self.p, impl=self.impl,
                                 shared_over_first_dim=self.shared_over_first_dim, sharding_text=self.sharding_text)

    def _dropout_of_shard(self, x):
        """This dropout's mask on DTensor ``x``'s shard (the output's or its gradient's)."""
        def dropout_of_block(x, *, global_shape, global_offset):
            return dropout_ops.apply(x, self.key_data, p=self.p, impl=self.impl,
                                     shared_over_first_dim=self.shared_over_first_dim, global_shape=global_shape,
                                     global_offset=global_offset)

        return dtensors.map_noise_blocks(x, (), dropout_of_block, impl=self.impl,
                                         shared_over_first_dim=self.shared_over_first_dim)

    def _on_planes(self, block_op, others: tuple) -> torch.Tensor:
        """``block_op(x, *others)`` of ``(*batch, L, S)`` weights and tensors of their batch dims
        (``others``), a kernel drawing the weights' attention mask; for DTensors split over
        batch dims (:func:`draws_attention_layout`), on each rank's planes, the kernel told
        where they are (``global_batch``, ``global_offset``)."""
        weights = self.x
        if not bridge.is_dtensor(weights):
            return block_op(weights, *others)
        _, offset = dtensors.local_block(tuple(weights.shape), weights.device_mesh, weights.placements)
        batch = tuple(weights.shape[:-2])
        first_plane = dtensors.flat_offset(offset[:-2], batch)
        return dtensors.on_local_shards(
            lambda *locals: block_op(*locals, global_batch=batch, global_offset=first_plane), weights.device_mesh,
            weights.placements, [(weights.placements, (*weights.shape[:-1], others[0].shape[-1]) if others
                                  else tuple(weights.shape))], weights, *others)

    def added_to(self, residual: torch.Tensor) -> torch.Tensor:
        """``residual + self.output()`` in one kernel (a mask over all of ``x`` only; for a
        DTensor, a residual placed as it is, on local shards)."""
        if self.key_data is None:
            return self.x * 0 + residual
        if self.attention_layout:
            return residual + self.output()
        if bridge.is_dtensor(self.x):
            if not dtensors.placements_match(self.x, residual):
                return residual + self.output()

            def added_to_block(x, residual, *, global_shape, global_offset):
                return dropout_ops.apply_add(x, residual, self.key_data, p=self.p, impl=self.impl,
                                             global_shape=global_shape, global_offset=global_offset)

            return dtensors.shardwise(
                self.x, residual, lambda x, residual: dtensors.map_noise_blocks(x, (residual,), added_to_block,
                                                                                impl=self.impl),
                self._dropout_of_shard)
        return dropout_ops.apply_add(self.x, residual, self.key_data, p=self.p, impl=self.impl,
                                     sharding_text=self.sharding_text)

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None, narrow=None) -> torch.Tensor:
        """``F.linear(self.output(), weight, bias)``: in one kernel when :func:`fuses_linear` says
        so; it reads ``narrow`` instead of ``self.x`` where ``self.x`` is ``narrow.to(float32)``
        of a 16-bit ``narrow``."""
        if self.attention_layout:
            return torch.nn.functional.linear(self.output(), weight, bias)
        if self.key_data is not None and bridge.is_dtensor(self.x):
            out = self._linear_of_shards(weight)
            if out is not None:
                return out if bias is None else out + bias
        if self.key_data is None or not fuses_linear(self, weight, narrow):
            return torch.nn.functional.linear(self.output(), weight, bias)
        x = self.x if narrow is None else narrow
        out = dropout_linear_ops.apply(x, weight, self.key_data, p=self.p, impl=self.impl,
                                       sharding_text=self.sharding_text)
        return out if bias is None else out + bias

    def _linear_of_shards(self, weight) -> torch.Tensor | None:
        """``F.linear(self.output(), weight)`` of DTensors, each rank's block in fused kernels on
        its shards where the placements let it (:func:`dtensors.linear_placements`): one per
        run of the block's rows (:func:`dtensors.row_runs`), padded before to a row its part of
        the mask can start at (:func:`kernels.dropout_linear.row_tile`); else ``None``."""
        x, shape = self.x, tuple(self.x.shape)
        placements = dtensors.linear_placements(x, weight)
        if (placements is None or weight.dtype != x.dtype or x.dtype not in _checks.FLOAT_DTYPES
                or not dropout_linear_kernels.takes(shape, self.impl)):
            return None
        runs = dtensors.row_runs(x)
        if runs is None:
            return None
        rows, first_rows = runs
        tile = dropout_linear_kernels.row_tile(shape, self.impl)

        def linear_of_block(x, weight):
            if x.numel() == 0:
                return torch.nn.functional.linear(x, weight)
            outputs = []
            for run, first_row in zip(x.reshape(len(first_rows), rows, shape[-1]), first_rows):
                before = first_row % tile
                out = dropout_linear_ops.apply(torch.nn.functional.pad(run, (0, 0, before, 0)), weight, self.key_data,
                                               p=self.p, impl=self.impl, global_shape=shape,
                                               first_row=first_row - before)
                outputs.append(out[before:])
            return torch.cat(outputs).reshape(*x.shape[:-1], weight.shape[0])

        return dtensors.on_local_shards(linear_of_block, x.device_mesh, placements,
                                        [(placements, (*shape[:-1], weight.shape[0]))], x, weight)

    def multiplied_by(self, value: torch.Tensor) -> torch.Tensor:
        """``self.output() @ value``: in one kernel when :func:`fuses_matmul` says so, or on each
        rank's shards of DTensors split over batch dims (:func:`matmul_of_shards_fuses`)."""
        if self.key_data is not None and matmul_of_shards_fuses(self, value):
            return self._on_planes(lambda weights, value, **block: dropout_matmul_ops.apply(
                weights, value, self.key_data, p=self.p, impl=self.impl, **block), (value,))
        if self.key_data is not None and fuses_matmul(self, value):
            return dropout_matmul_ops.apply(self.x, value, self.key_data, p=self.p, impl=self.impl)
        return torch.matmul(self.output(), value)


def _matmul_kernel_takes(drawn: DrawnDropout, value) -> bool:
    """Whether a dropout_matmul kernel takes ``drawn``'s input times ``value``: weights
    ``(*batch, L, S)`` and a value ``(*batch, S, Ev)`` of one batch (no broadcasting) and dtype
    (a kernel's: not float64), a mask not shared over the first dim."""
    weights = drawn.x
    if not (isinstance(value, torch.Tensor) and value.dtype == weights.dtype and weights.dtype in _checks.FLOAT_DTYPES
            and not drawn.shared_over_first_dim):
        return False
    try:
        check_matmul_shapes(weights.shape, value.shape)
    except ValueError:
        return False
    return True


def draws_attention_layout(x: torch.Tensor, impl: str, shared_over_first_dim: bool = False,
                           sharding_text: str | None = None) -> bool:
    """Whether a dropout of attention weights ``x`` draws its mask as the attention kernels draw
    theirs: with a per-tile impl (threefry's mask is the same either way, drawn from each
    element's flat index), weights ``(*batch, L, S)`` of a kernel's dtype, one mask over all of
    them, on one device (not split by SPMD sharding) or a DTensor split over batch dims only
    (each rank draws its planes' part)."""
    return (prng.per_tile(impl) and x.dim() >= 2 and x.dtype in _checks.FLOAT_DTYPES and not shared_over_first_dim
            and sharding_text is None
            and (not bridge.is_dtensor(x) or _split_over_batch_dims(x)))


def _split_over_batch_dims(x) -> bool:
    """Whether DTensor ``x`` ``(*batch, L, S)`` is replicated or split over its batch dims only."""
    return all(isinstance(placement, dtensors.Replicate)
               or (type(placement) is dtensors.Shard and placement.dim % x.dim() < x.dim() - 2)
               for placement in x.placements)


def _draws_kernels_mask(drawn: DrawnDropout) -> bool:
    """Whether ``drawn``'s mask is the one the dropout_matmul and attention kernels draw for its
    input: its attention layout, or threefry's (the same mask in either layout)."""
    return drawn.attention_layout or not prng.per_tile(drawn.impl)


def fuses_matmul(drawn: DrawnDropout, value) -> bool:
    """Whether ``drawn``'s output times ``value`` runs as one dropout_matmul kernel: a pair the
    kernel takes (:func:`_matmul_kernel_takes`) on one device, a mask over the whole unsharded
    weights, drawn as the kernel draws it (:func:`_draws_kernels_mask`)."""
    weights = drawn.x
    return (_matmul_kernel_takes(drawn, value) and _draws_kernels_mask(drawn)
            and value.device == weights.device and not bridge.is_dtensor(weights)
            and not bridge.is_dtensor(value) and drawn.sharding_text is None and sharding.resolve(value) is None)


def matmul_of_shards_fuses(drawn: DrawnDropout, value) -> bool:
    """Whether ``drawn``'s output times ``value``, DTensors, runs as a dropout_matmul kernel on
    each rank's shards: a pair the kernel takes, placed alike, split over batch dims only."""
    weights = drawn.x
    return (bridge.is_dtensor(weights) and bridge.is_dtensor(value) and value.device_mesh == weights.device_mesh
            and value.placements == weights.placements and _split_over_batch_dims(weights)
            and _matmul_kernel_takes(drawn, value) and _draws_kernels_mask(drawn))


def fuses_linear(drawn: DrawnDropout, weight, narrow=None) -> bool:
    """Whether ``F.linear(drawn.output(), weight)`` runs as one dropout_linear kernel: a 2-D
    weight of the input's dtype (a kernel's: not float64) and device, a mask drawn over the
    input's rows (:func:`kernels.dropout_linear.takes`), the input and weight unsharded, or the
    input split by SPMD into shards of its rows (:func:`_shards_of_rows`: a kernel per shard);
    with ``narrow``, the 16-bit tensor whose ``.to(float32)`` the input is, read in its place."""
    x = drawn.x
    if narrow is not None and not (narrow.shape == x.shape and narrow.device == x.device
                                   and dropout_linear_kernels.widens(_checks.jax_dtype_name(narrow.dtype),
                                                                     _checks.jax_dtype_name(x.dtype))):
        return False
    return (isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.dtype == x.dtype
            and weight.device == x.device and not bridge.is_dtensor(x) and not bridge.is_dtensor(weight)
            and x.dtype in _checks.FLOAT_DTYPES and not drawn.shared_over_first_dim
            and dropout_linear_kernels.takes(tuple(x.shape), drawn.impl)
            and (sharding.resolve(weight) is None if drawn.sharding_text is None
                 else _shards_of_rows(drawn.sharding_text, tuple(x.shape), drawn.impl)))


def _shards_of_rows(sharding_text: str, shape: tuple, impl: str) -> bool:
    """Whether an SPMD sharding of ``x`` of ``shape`` gives each device a block of its rows that
    the dropout_linear kernels draw the mask of (the weight is gathered whole onto each device):
    one dim split, all before it of size 1, and each shard's first row one the mask can start
    at (:func:`kernels.dropout_linear.row_tile`)."""
    split = Sharding.parse(sharding_text, len(shape))
    if split is None or split.tiles[-1] > 1 or sum(tiles > 1 for tiles in split.tiles) != 1:
        return False
    dim = dropout_linear_ops.split_dim(split)
    local = split.shard_shape(shape)
    rows = math.prod(local[:-1])
    return (math.prod(shape[:dim]) == 1 and rows % dropout_linear_kernels.row_tile(shape, impl) == 0
            and dropout_linear_kernels.takes_rows(local, shape, 0, impl))


def draw_dropout(x: torch.Tensor, p, training: bool, seed, generator, impl, shared_over_first_dim: bool,
                 sharding: Optional[Sharding], attention_weights: bool = False) -> DrawnDropout | None:
    """Checks :func:`dropout`'s arguments and draws its key; ``None`` when nothing is dropped
    (``training=False`` or ``p == 0``), with no key drawn. ``attention_weights``: ``x`` holds
    attention weights, whose mask is then drawn in the attention kernels' layout where
    :func:`draws_attention_layout` says it can be."""
    p, impl = _checks.noise_arguments(p, impl, seed, generator)
    if shared_over_first_dim and x.dim() == 0:
        raise ValueError("shared_over_first_dim needs an input with at least one dimension")
    if not training or p == 0.0:
        return None
    _checks.check_float_tensor(x, "x", _checks.DROPOUT_DTYPES, dtensors=True)
    if bridge.is_dtensor(x):
        dtensors.check_placements(x)
    if p == 1.0:
        return DrawnDropout(x, None, p, impl, shared_over_first_dim, None)
    sharding_text = None if sharding is None else sharding.check(x.shape, "x", impl, shared_over_first_dim)
    attention_layout = attention_weights and draws_attention_layout(x, impl, shared_over_first_dim, sharding_text)
    return DrawnDropout(x, seeds.draw(seed, generator, bridge.device_of(x)), p, impl, shared_over_first_dim,
                        sharding_text, attention_layout)


def dropout_add(x: torch.Tensor, residual: torch.Tensor, p: float = 0.5, training: bool = True, *, seed=None,
                generator=None, impl=None) -> torch.Tensor:
    r"""Returns ``residual + dropout(x, p)`` computed in one kernel (Megatron's
    ``bias_dropout_add`` fusion, with the bias already in ``x``).

    The kernel reads ``x`` and ``residual`` and writes the sum once, where
    ``residual + torch_pallas.dropout(x, p)`` writes the dropout's output and reads it back:
    on a TPU, where XLA fuses its own dropout into the add but cannot fuse a Pallas kernel,
    that is a whole pass over the tensor fewer. The mask is :func:`dropout`'s for the same
    key (bit for bit ``jax.random.bernoulli`` with ``impl="threefry"``); the sum is computed
    in float32 and rounded once, so it may differ from the unfused sum by one rounding. The
    backward pass is :func:`dropout`'s kernel on the gradient (from the 8-byte key) for
    ``x`` and the gradient itself for ``residual``.

    Args:
        x (Tensor): what is dropped, as for :func:`dropout`.
        residual (Tensor): what is added: ``x``'s shape, dtype and device.
        p, training, seed, generator, impl: as for :func:`dropout`.

    Returns:
        Tensor: ``residual + dropout(x)``, a new tensor of ``x``'s shape and dtype
        (``x + residual`` when nothing is dropped: ``training=False`` or ``p == 0``).

    Raises:
        TypeError: as :func:`dropout`, and a ``residual`` that is not a tensor of ``x``'s dtype.
        ValueError: as :func:`dropout`, and a ``residual`` of another shape or device than ``x``.

    Example::

        >>> hidden = torch_pallas.dropout_add(attention_output, hidden, p=0.1)
    """
    _checks.check_tensor(x, "x")
    _checks.check_tensor(residual, "residual")
    if residual.dtype != x.dtype:
        raise TypeError(f"residual must have x's dtype {x.dtype}, got {residual.dtype}")
    if residual.shape != x.shape or residual.device != x.device:
        raise ValueError(f"residual must have x's shape {tuple(x.shape)} on {x.device}, got "
                         f"{tuple(residual.shape)} on {residual.device}")
    drawn = draw_dropout(x, p, training, seed, generator, impl, False, sharding.resolve(x))
    return x + residual if drawn is None else drawn.added_to(residual)


def dropout_matmul(weights: torch.Tensor, value: torch.Tensor, p: float = 0.5, training: bool = True, *, seed=None,
                   generator=None, impl=None) -> torch.Tensor:
    r"""Returns ``dropout(weights, p) @ value`` computed in one kernel: eager attention's
    ``torch.matmul(dropout(softmax(scores)), value)``.

    Apart, the dropout writes the dropped weights, the product reads them back, and autograd
    keeps them for ``value``'s gradient: a tensor of the weights' size kept per layer. Fused,
    the kernel reads the weights once, and the backward kernel regenerates the mask from the
    8-byte key, keeping only ``weights`` and ``value`` (the softmax before them keeps the
    weights anyway). A kept weight is ``weights / (1 - p)`` rounded to its dtype, as
    :func:`dropout` computes it; the products accumulate in float32.

    The mask is that of :func:`torch_pallas.scaled_dot_product_attention`'s dropout for
    ``(*batch, L, S)`` weights (:ref:`attention's mask <attention-mask>`): with
    ``impl="threefry"`` :func:`dropout`'s for the same key (bit for bit
    ``jax.random.bernoulli(key, 1 - p, weights.shape)``); with ``impl="hardware"`` or
    ``"tiled"`` drawn per tile of each ``L x S`` plane, which is not the mask :func:`dropout`
    draws for the same key.

    One kernel runs for weights ``(*batch, L, S)`` and a value ``(*batch, S, Ev)`` with the
    same batch dims, of one dtype among float32, bfloat16 and float16, not split by SPMD
    sharding, or DTensors placed alike and split over batch dims only (the kernel on each rank's
    planes). Any other pair :func:`torch.matmul` takes is computed as the weights dropped with
    that mask (a kernel of their own) and then the product; float64 and SPMD-sharded weights,
    which no kernel draws that mask for, as ``dropout(weights, p) @ value``; so is any other
    DTensor pair (:ref:`DTensors <dtensors>`), with ``impl="threefry"`` only.

    Args:
        weights (Tensor): what is dropped, as ``x`` for :func:`dropout`.
        value (Tensor): what it multiplies: a tensor of ``weights``' dtype and device that
            :func:`torch.matmul` takes with it.
        p, training, seed, generator, impl: as for :func:`dropout`.

    Returns:
        Tensor: ``dropout(weights, p) @ value`` (``weights @ value`` when nothing is dropped:
        ``training=False`` or ``p == 0``).

    Raises:
        TypeError: as :func:`dropout`, and a ``value`` that is not a tensor of ``weights``'
            dtype.
        ValueError: as :func:`dropout`, a ``value`` on another device than ``weights``, and
            DTensors the kernel does not take with the per-tile impls.

    Example::

        >>> weights = torch.softmax(query @ key.transpose(-2, -1) * scale, dim=-1)
        >>> out = torch_pallas.dropout_matmul(weights, value, p=0.1)
    """
    _checks.check_tensor(weights, "weights")
    _checks.check_tensor(value, "value")
    if value.dtype != weights.dtype:
        raise TypeError(f"value must have weights' dtype {weights.dtype}, got {value.dtype}")
    if value.device != weights.device:
        raise ValueError(f"value must be on weights' device {weights.device}, got {value.device}")
    drawn = draw_dropout(weights, p, training, seed, generator, impl, False, sharding.resolve(weights),
                         attention_weights=True)
    if (drawn is not None and drawn.key_data is not None and bridge.is_dtensor(weights)
            and prng.per_tile(drawn.impl) and not matmul_of_shards_fuses(drawn, value)):
        raise ValueError(f"dropout_matmul of DTensors runs the fused kernel on each rank's shards when weights "
                         f"(*batch, L, S) and value (*batch, S, Ev) are placed alike, split over batch dims only; "
                         f'other DTensors run as dropout, then matmul, whose mask with impl="{drawn.impl}" is not '
                         "the fused kernel's (that one is drawn per tile of each L x S plane): redistribute them, "
                         'or pass impl="threefry", whose masks are the same')
    return torch.matmul(weights, value) if drawn is None else drawn.multiplied_by(value)


def dropout_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, p: float = 0.5,
                   training: bool = True, *, seed=None, generator=None, impl=None) -> torch.Tensor:
    r"""Returns ``F.linear(dropout(x, p), weight, bias)`` computed in one kernel: a linear layer
    after its input's dropout, as PEFT's LoRA computes ``lora_A(dropout(x))``, T5's feed-forward
    ``wo(dropout(h))`` or a classifier head after its dropout.

    Apart, the dropout writes the dropped ``x``, the product reads it back, and autograd keeps it
    for the weight's gradient: a copy of ``x`` per layer that drops it. Fused, the kernel reads
    ``x`` once and the backward kernel regenerates the mask from the 8-byte key, keeping only
    ``x`` (which layers dropping one ``x`` with their own keys share) and the weight. The mask is
    :func:`dropout`'s for the same key, bit for bit, on every impl; a kept element is ``x / (1 -
    p)`` rounded to ``x``'s dtype, as :func:`dropout` writes it; the products accumulate in
    float32, and the weight's gradient is summed in float32 and rounded once.

    One kernel runs for ``x (..., K)`` and ``weight (N, K)`` of one dtype among float32, bfloat16
    and float16, on one device, not split by SPMD sharding, whose rows ``(M, K)`` are the dropout's
    own view of ``x`` (with the per-tile impls, ``"tiled"`` and ``"hardware"``: ``K`` a multiple
    of 128, at least 8 rows, and not a 3-D ``(B, L, C)`` whose ``L`` is not a multiple of 8 while
    ``B`` is). Any other pair :func:`torch.nn.functional.linear` takes is computed as
    ``F.linear(dropout(x, p), weight, bias)``: the same values and mask. DTensors run the kernel
    on each rank's shards where ``x``'s rows or the weight's output features are split (and
    otherwise unfused; :ref:`DTensors <dtensors>`).

    Args:
        x (Tensor): what is dropped, as for :func:`dropout`: ``(..., K)``.
        weight (Tensor): ``(N, K)``, of ``x``'s dtype and device.
        bias (Tensor, optional): ``(N,)``, added to the product.
        p, training, seed, generator, impl: as for :func:`dropout`.

    Returns:
        Tensor: ``(..., N)`` (``F.linear(x, weight, bias)`` when nothing is dropped:
        ``training=False`` or ``p == 0``).

    Raises:
        TypeError: as :func:`dropout`, and a ``weight`` or ``bias`` that is not a tensor of
            ``x``'s dtype.
        ValueError: as :func:`dropout`, and a ``weight`` that is not ``(N, K)``, a ``bias`` that
            is not ``(N,)``, or either on another device than ``x``.

    Example::

        >>> lora_down = torch_pallas.dropout_linear(hidden, lora_A.weight, p=0.1)   # lora_A(dropout(hidden))
    """
    _checks.check_tensor(x, "x")
    for name, tensor in (("weight", weight), ("bias", bias)):
        if tensor is None and name == "bias":
            continue
        _checks.check_tensor(tensor, name)
        if tensor.dtype != x.dtype:
            raise TypeError(f"{name} must have x's dtype {x.dtype}, got {tensor.dtype}")
        if tensor.device != x.device:
            raise ValueError(f"{name} must be on x's device {x.device}, got {tensor.device}")
    if x.dim() == 0 or weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"weight must be (N, K) for x (..., K), got {tuple(weight.shape)} for x of shape "
                         f"{tuple(x.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be ({weight.shape[0]},), one per output feature, got {tuple(bias.shape)}")
    drawn = draw_dropout(x, p, training, seed, generator, impl, False, sharding.resolve(x))
    return torch.nn.functional.linear(x, weight, bias) if drawn is None else drawn.linear(weight, bias)


def _feature_dropout(x, p, training, inplace, seed, generator, impl, *, spatial_dims: int):
    """Channel dropout as torch's ``dropout1d/2d/3d``: one mask element per (sample, channel)
    for a batched input, per channel for an unbatched one (torch's rules for other ranks)."""
    name = f"dropout{spatial_dims}d"
    _checks.check_tensor(x, "x")
    p, impl = _checks.noise_arguments(p, impl, seed, generator)
    ranks = f"{spatial_dims + 1}D or {spatial_dims + 2}D"
    # torch's words, which end every message and warning about ranks
    note = (f"Note that {name} exists to provide channel-wise dropout on inputs with {spatial_dims} spatial "
            f"dimension{'s' if spatial_dims > 1 else ''}, a channel dimension, and an optional batch dimension "
            f"(i.e. {ranks} inputs).")
    if name == "dropout1d" and x.dim() not in (2, 3):
        raise _checks.TorchRuntimeError(f"dropout1d: Expected {ranks} input, but received a {x.dim()}D input. {note}")
    if x.dim() < 2:
        raise ValueError(f"{name} needs an input with a channel dimension (at least 2-D), got shape "
                         f"{tuple(x.shape)}")
    if x.dim() not in (spatial_dims + 1, spatial_dims + 2):
        # torch warns (and goes on) in the same words
        _checks.warn(f"{name}: Received a {x.dim()}-D input to {name}, which is deprecated and will result "
                     f"in an error in a future release. To retain the behavior and silence this warning, "
                     f"please use dropout instead. {note}", stacklevel=3)
    if name == "dropout2d" and x.dim() == 3:
        _checks.warn("dropout2d: Received a 3D input to dropout2d and assuming that channel-wise 1D dropout "
                     "behavior is desired - input is interpreted as shape (N, C, L), where C is the channel "
                     "dim. This behavior will change in a future release to interpret the input as one without "
                     "a batch dimension, i.e. shape (C, H, W). To maintain the 1D channel-wise dropout behavior, "
                     "please switch to using dropout1d instead.", stacklevel=3)
    if not training or p == 0.0:
        return x
    _checks.check_float_tensor(x, "x", _checks.DROPOUT_DTYPES, dtensors=True)
    # torch.nn.functional.dropout2d takes any 3-D input as batched (N, C, L).
    leading = 2 if x.dim() == spatial_dims + 2 or name == "dropout2d" else 1
    channels = x.shape[:leading]
    if p == 1.0:
        output = x * 0
    else:
        scale = _channel_scale(x, channels, p, seed, generator, impl)
        if bridge.is_dtensor(x):
            output = dtensors.shardwise(x, None, lambda x, _: dtensors.map_channels(x, scale),
                                        lambda grad: dtensors.map_channels(grad, scale))
        else:
            output = x * scale.reshape(*channels, *[1] * (x.dim() - leading))
    return x.copy_(output) if inplace else output


def _channel_scale(x, channels, p, seed, generator, impl) -> torch.Tensor:
    """The dropout of ones of shape ``channels``: 0 or 1 / (1 - p) per channel (a plain tensor
    on the device of ``x``'s, or of a DTensor's local shard)."""
    device = bridge.device_of(x)
    ones = torch.ones(channels, dtype=x.dtype, device=device) if bridge.is_dtensor(x) else x.new_ones(channels)
    return dropout_ops.apply(ones, seeds.draw(seed, generator, device), p=p, impl=impl)


_FEATURE_DROPOUT_DOC = r"""Randomly zeroes entire channels of ``x`` with probability ``p`` and scales the rest
    by :math:`1/(1-p)`, as :func:`torch.nn.functional.{name}`.

    A channel is ``x[n, c]`` for a batched ``{batched}`` input, ``x[c]`` for an unbatched
    ``{unbatched}`` one. The mask over the leading (sample, channel) dims is drawn from a PRNG
    key as :func:`torch_pallas.dropout` draws it (with ``impl="threefry"``, bit for bit
    ``jax.random.bernoulli(key, 1 - p, x.shape[:2])`` for a batched input), and is small: the
    autograd graph keeps it (one element per channel) rather than the key.{extra}

    Args:
        x (Tensor): ``{batched}`` or ``{unbatched}``, of a dtype dropout takes (:ref:`dtypes`)
            on a device torch_pallas runs on (:ref:`devices`).
        p (float): probability of a channel being zeroed, in :math:`[0, 1]`. Default: 0.5.
        training, inplace, seed, generator, impl: as for :func:`torch_pallas.dropout`.

    Returns:
        Tensor: same shape and dtype as ``x``.

    Raises:
        TypeError, ValueError: as :func:`torch_pallas.dropout`; ValueError also for an input
            without a channel dimension{raises}.
    """


def dropout1d(x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False, *, seed=None,
              generator=None, impl=None) -> torch.Tensor:
    return _feature_dropout(x, p, training, inplace, seed, generator, impl, spatial_dims=1)


def dropout2d(x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False, *, seed=None,
              generator=None, impl=None) -> torch.Tensor:
    return _feature_dropout(x, p, training, inplace, seed, generator, impl, spatial_dims=2)


def dropout3d(x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False, *, seed=None,
              generator=None, impl=None) -> torch.Tensor:
    return _feature_dropout(x, p, training, inplace, seed, generator, impl, spatial_dims=3)


dropout1d.__doc__ = _FEATURE_DROPOUT_DOC.format(
    name="dropout1d", batched="(N, C, L)", unbatched="(C, L)", extra="",
    raises="; for one that is not 2-D or 3-D, torch's RuntimeError (\"dropout1d: Expected 2D or 3D input, but "
           "received a 4D input. ...\"), raised as an exception that is both a RuntimeError and a ValueError")
dropout2d.__doc__ = _FEATURE_DROPOUT_DOC.format(
    name="dropout2d", batched="(N, C, H, W)", unbatched="(C, H, W)",
    extra=" As torch's, a 3-D input is taken as a batched ``(N, C, L)`` (with torch's warning), and "
          "other ranks than 3 and 4 warn that torch will reject them.", raises="")
dropout3d.__doc__ = _FEATURE_DROPOUT_DOC.format(
    name="dropout3d", batched="(N, C, D, H, W)", unbatched="(C, D, H, W)",
    extra=" As torch's, other ranks than 4 and 5 warn and are taken as unbatched.", raises="")


def indrnn(x: torch.Tensor, weight: torch.Tensor, h0: torch.Tensor | None = None, *, nonlinearity: str = "relu",
           batch_first: bool = False, lengths=None, mesh=None, partition_spec=None) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Runs the IndRNN recurrence :math:`h_t = \sigma(x_t + w \odot h_{t-1})` over a sequence.

    Every feature has its own recurrent weight, so the recurrence is elementwise: one Pallas
    kernel carries each (batch, feature) block's state in fast memory across all time steps,
    and a second runs the backward pass in reverse time from the saved outputs. ``x`` is the
    already-projected input (see :class:`torch_pallas.nn.IndRNN` for the full layer).

    Args:
        x (Tensor): ``(T, B, F)``, or ``(B, T, F)`` with ``batch_first``; float32, bfloat16
            or float16 (:ref:`dtypes`), on a device torch_pallas runs on (:ref:`devices`).
        weight (Tensor): ``(F,)`` recurrent weights, a float dtype.
        h0 (Tensor, optional): ``(B, F)`` initial state; zeros if ``None``.
        nonlinearity (str): ``"relu"`` (default) or ``"tanh"``.
        batch_first (bool): whether ``x`` and ``output`` are ``(B, T, F)``.
        lengths (Tensor or list of int, optional): ``(B,)`` steps per sequence, for a batch
            of sequences of different lengths padded to ``T`` (as
            :func:`torch.nn.utils.rnn.pad_packed_sequence` returns them): sequence ``b``
            runs steps ``t < lengths[b]``, its output is 0 after them, ``h_n[b]`` is its last
            state, and nothing flows back from the padding. The lengths are data for the
            kernels: new values do not recompile. Integers in :math:`[0, T]` (checked when
            they are a list or a CPU tensor; on an XLA device they are clipped to it).
        mesh, partition_spec: in SPMD mode, how ``x`` is sharded, as for :func:`dropout`
            (default: the sharding ``x`` carries, in eager mode).

    An SPMD-sharded ``x`` (``xs.mark_sharding``) split over batch and/or features runs shard
    by shard on its devices, forward and backward; the weight gradient is summed over the
    batch shards in a fixed order. So does a DTensor ``x`` (:ref:`DTensors <dtensors>`), with
    a DTensor ``weight`` split as ``x``'s features (else replicated) and ``h0`` as ``x``'s batch
    and features; ``lengths`` are the whole batch's.

    Returns:
        (Tensor, Tensor): ``output`` (x's shape and dtype: every :math:`h_t`) and ``h_n``
        ``(B, F)`` in x's dtype. The state is carried and accumulated in float32.

    Raises:
        TypeError: a non-tensor or a non-float tensor (integer dtypes included).
        ValueError: ``x`` not 3-D, ``weight`` not ``(F,)``, ``h0`` not ``(B, F)``, an
            unknown ``nonlinearity``, a tensor on none of those devices, ``lengths`` not
            ``(B,)`` integers in :math:`[0, T]`, an SPMD-sharded ``x`` split along time
            or into uneven shards, or a DTensor ``x`` split along time, or whose ``weight``
            or ``h0`` are not DTensors placed to match it.

    Example::

        >>> x = torch.randn(100, 8, 256, device=torch_xla.device(), requires_grad=True)
        >>> w = torch.rand(256, device=torch_xla.device(), requires_grad=True)
        >>> output, h_n = torch_pallas.indrnn(x, w)
        >>> output.sum().backward()
    """
    _checks.check_float_tensor(x, "x", dtensors=True)
    if bridge.is_dtensor(x):
        return _indrnn_of_dtensors(x, weight, h0, nonlinearity=nonlinearity, batch_first=batch_first, lengths=lengths)
    return indrnn_under_sharding(x, weight, h0, nonlinearity=nonlinearity, batch_first=batch_first, lengths=lengths,
                                 sharding=sharding.resolve(x, mesh, partition_spec))


def _indrnn_of_dtensors(x, weight, h0, *, nonlinearity: str, batch_first: bool, lengths):
    """:func:`indrnn` of a DTensor ``x`` split over batch and/or features: each rank runs the
    kernels on its shard, with ``weight`` (and ``h0``) DTensors placed to match (the weight's
    gradient summed over the batch shards)."""
    check_nonlinearity(nonlinearity)
    if x.dim() != 3:
        raise ValueError(f"x must be 3-D {'(B, T, F)' if batch_first else '(T, B, F)'}, got shape {tuple(x.shape)}")
    dtensors.check_placements(x)
    time, batch = (1, 0) if batch_first else (0, 1)
    state_placements, weight_placements = [], []
    for placement in x.placements:
        dim = placement.dim % 3 if isinstance(placement, dtensors.Shard) else None
        if dim == time or isinstance(placement, dtensors.Partial):
            raise ValueError(f"x is placed {placement}; IndRNN runs each sequence's steps in order on one rank: split x "
                             "over batch and/or features only")
        state_placements.append(placement if dim is None else dtensors.Shard(0 if dim == batch else 1))
        weight_placements.append(dtensors.Shard(0) if dim == 2 else dtensors.Replicate())
    features = x.shape[2]
    state_shape = (x.shape[batch], features)
    for name, tensor, placements, shape in (("weight", weight, weight_placements, (features,)),
                                            ("h0", h0, state_placements, state_shape)):
        if tensor is None:
            continue
        _checks.check_float_tensor(tensor, name, dtensors=True)
        if not bridge.is_dtensor(tensor) or tensor.device_mesh != x.device_mesh or tuple(tensor.placements) != tuple(
                placements) or tuple(tensor.shape) != shape:
            raise ValueError(f"{name} must be a DTensor of shape {shape} on x's mesh placed {placements} to match x "
                             f"(distribute_tensor({name}, mesh, {placements}))")
    if lengths is not None:
        lengths = _checks.check_lengths(lengths, torch.device("cpu"), x.shape[time], x.shape[batch])
        local_shape, offset = dtensors.local_block(tuple(x.shape), x.device_mesh, x.placements)
        lengths = lengths[offset[batch]:offset[batch] + local_shape[batch]].to(bridge.device_of(x))
    inputs = (x, weight) if h0 is None else (x, weight, h0)

    def local_indrnn(x, weight, h0=None):
        return indrnn_under_sharding(x, weight, h0, nonlinearity=nonlinearity, batch_first=batch_first,
                                     lengths=lengths, sharding=None)

    return dtensors.on_local_shards(local_indrnn, x.device_mesh, x.placements,
                                    [(x.placements, x.shape), (state_placements, state_shape)], *inputs)


def indrnn_under_sharding(x: torch.Tensor, weight: torch.Tensor, h0: torch.Tensor | None, *, nonlinearity: str,
                          batch_first: bool, lengths, sharding: Optional[Sharding]):
    """:func:`indrnn` of a float tensor ``x`` whose ``sharding`` (of ``x`` as given; ``None``:
    the kernels run on the whole tensor) is resolved: the path of the function and of the
    module, which resolves its own when it is built."""
    check_nonlinearity(nonlinearity)
    _checks.check_float_tensor(weight, "weight")
    if x.dim() != 3:
        layout = "(B, T, F)" if batch_first else "(T, B, F)"
        raise ValueError(f"x must be 3-D {layout}, got shape {tuple(x.shape)}")
    time_major = x.transpose(0, 1) if batch_first else x
    _, batch, features = time_major.shape
    if weight.shape != (features,):
        raise ValueError(f"weight must have shape ({features},) to match x's {features} features, "
                         f"got {tuple(weight.shape)}")
    if h0 is None:
        h0 = x.new_zeros(batch, features)
    else:
        _checks.check_float_tensor(h0, "h0")
        if h0.shape != (batch, features):
            raise ValueError(f"h0 must have shape ({batch}, {features}) to match x, got {tuple(h0.shape)}")
    if lengths is not None:
        lengths = _checks.check_lengths(lengths, x.device, *time_major.shape[:2])
    time_major_sharding_text = None
    if sharding is not None:
        sharding.check(x.shape, "x")
        time = 1 if batch_first else 0
        if sharding.tiles[time] > 1:
            raise ValueError(
                f"x is split along time into {sharding.tiles[time]} shards; IndRNN runs each sequence's steps in "
                "order on one device: shard x over batch and/or features only")
        time_major_sharding_text = (sharding.permute((1, 0, 2)) if batch_first else sharding).text
    output, h_n = indrnn_ops.apply(time_major.contiguous(), weight, h0, lengths, nonlinearity=nonlinearity,
                                   sharding_text=time_major_sharding_text)
    return (output.transpose(0, 1) if batch_first else output), h_n
