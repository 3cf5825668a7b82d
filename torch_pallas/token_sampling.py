"""Per-request seeded token sampling: :func:`sample_tokens`, and :class:`SeededSampling` for
transformers' ``generate``."""

from __future__ import annotations

import numbers
from typing import NamedTuple, Optional

import torch

from torch_pallas import _checks, bridge, dtensors, seeds as seed_module, sharding
from torch_pallas.kernels import token_sampling as token_sampling_kernels
from torch_pallas.ops import token_sampling as token_sampling_ops

__all__ = ["sample_tokens", "SeededSampling"]

_LOGITS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class SampledTokens(NamedTuple):
    """:func:`sample_tokens`' result with ``return_logprobs=True``."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    raw_logprobs: torch.Tensor
_POSITION_BOUND = 2**32


def _low_word(values: torch.Tensor) -> torch.Tensor:
    """int32 of the low 32 bits of int64 ``values`` (the same bits, wrapped into int32's range
    before the cast, whose out-of-range behaviour differs between devices)."""
    return (((values & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000).to(torch.int32)


def _high_word(values: torch.Tensor) -> torch.Tensor:
    """int64 ``values >> 32`` (arithmetic) as ``torch.bitwise_right_shift``: torch_xla 2.9's
    ``__rshift__`` gives ``-1 >> 32 == 0`` (and its int64 division is inexact past 2**53),
    2026-12-02."""
    return torch.bitwise_right_shift(values, 32)


def _whole(value, name: str):
    """A per-row argument that is a DTensor as the plain tensor of its values, on every rank
    (``full_tensor``: a replicated one's local tensor, a sharded one gathered; it is ``(B,)``).

    Raises:
        ValueError: a ``Partial`` DTensor (its values are not the rows')."""
    if not bridge.is_dtensor(value):
        return value
    if any(placement.is_partial() for placement in value.placements):
        raise ValueError(f"{name} is a DTensor placed {list(value.placements)}: a Partial sum is not one value per "
                         f"row; redistribute it to Replicate() first")
    return value.full_tensor()


def _words(values, name: str, batch: int, device: torch.device, bound: int, words: int) -> torch.Tensor:
    """int32 ``(batch, words)`` tensor on ``device`` of the high and low (``words=2``) or low
    (``words=1``) 32-bit words of a tensor of integers (their 64 bits, unread on the host; a
    DTensor's whole values: :func:`_whole`) or of a sequence of ints in ``[0, bound)`` (checked,
    split here: torchax holds no int64 without JAX's x64)."""
    values = _whole(values, name)
    if isinstance(values, torch.Tensor):
        if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got {values.dtype}")
        if values.shape != (batch,):
            raise ValueError(f"{name} must have shape ({batch},), one per row of logits, got {tuple(values.shape)}")
        # Split where the tensor is (a CPU tensor's int64 is whole; torchax's int64 is int32 without x64,
        # whose values are their own low word), then moved.
        values = values.to(torch.int64)
        if values.dtype != torch.int64:
            split = [torch.where(values < 0, -1, 0).to(values.dtype), values]
        else:
            split = [_low_word(_high_word(values)), _low_word(values)]
        return torch.stack(split[-words:], dim=1).to(device=device, dtype=torch.int32)
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise TypeError(f"{name} must be a tensor of integers or a sequence of ints, got {type(values).__name__}")
    if len(values) != batch:
        raise ValueError(f"{name} must have {batch} values, one per row of logits, got {len(values)}")
    split = []
    for value in values:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must hold ints, got {type(value).__name__} {value!r}")
        if not 0 <= value < bound:
            raise ValueError(f"{name} must be in [0, {'2**64' if bound == 2**64 else '2**32'}), got {value}")
        split.append(list(seed_module.signed_key_words(int(value)))[-words:])
    return torch.tensor(split, dtype=torch.int32, device=device).reshape(batch, words)


def _per_row(value, name: str, batch: int, device: torch.device, *, integer: bool, low, high, low_open: bool,
             off) -> Optional[torch.Tensor]:
    """A sampling parameter as the op takes it: ``None`` where every row has it off (``value``
    is ``None`` or the number ``off``), else a ``(batch,)`` int32 or float32 tensor. Numbers are
    checked against ``[low, high]`` (``(low, high]`` with ``low_open``); a tensor's values are
    not read (that would wait for the device), so out of range they act as documented."""
    if value is None:
        return None
    dtype = torch.int32 if integer else torch.float32
    value = _whole(value, name)
    if isinstance(value, torch.Tensor):
        if integer and (value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool):
            raise TypeError(f"{name} must hold integers, got {value.dtype}")
        if not integer and not value.dtype.is_floating_point:
            raise TypeError(f"{name} must hold floats, got {value.dtype}")
        if value.shape != (batch,):
            raise ValueError(f"{name} must be a number or have shape ({batch},), one per row of logits, got "
                             f"{tuple(value.shape)}")
        return value.to(device=device, dtype=dtype)
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        raise TypeError(f"{name} must be {'an int' if integer else 'a float'} or a tensor, got "
                        f"{type(value).__name__} {value!r}")
    interval = f"{'(' if low_open else '['}{low}, {high}]"
    if not ((low < value) if low_open else (low <= value)) or not value <= high:  # NaN fails too
        raise ValueError(f"{name} must be in {interval}, got {value}")
    if value == off:
        return None
    return torch.full((batch,), value, dtype=dtype, device=device)


def sample_tokens(logits: torch.Tensor, seeds, positions, *, temperature=1.0, top_k=None, top_p=None,
                  min_p=None, return_logprobs: bool = False):
    r"""Samples one token per row of ``logits``, each a function of its row, its seed, its
    position and its parameters alone: the same token whatever the batch, the row's slot, the
    other rows, the kernel's vocabulary blocks and the stack, and again after a preemption.

    Row ``b`` draws from ``softmax(logits[b] / temperature[b])`` restricted by min-p, then
    top-k, then top-p (vLLM's order), by the Gumbel-max trick with noise keyed by
    ``(seeds[b], positions[b])`` through two full-strength Threefry-2x32-20 mixes (so related
    seeds and positions give unrelated noise): :mod:`torch_pallas.kernels.token_sampling`
    states every step.

    Args:
        logits (Tensor): ``(B, V)``, float32, bfloat16 or float16, ``V < 2**20``.
        seeds (Tensor or sequence of ints): ``(B,)``, one per row: ints in :math:`[0, 2^{64})`,
            or a tensor of integers whose 64 bits are the seed (a negative int64 ``-x`` is seed
            :math:`2^{64} - x`, as the same bits).
        positions (Tensor or sequence of ints): ``(B,)``, the index of the token being sampled
            in its request (any count the caller keeps, such as the number of tokens generated
            so far): ints in :math:`[0, 2^{32})`, or a tensor whose low 32 bits are the position.
        temperature (float or Tensor): one for every row or ``(B,)``; below ``1e-5`` (0
            included, and negative values in a tensor, as vLLM pads) the row is greedy: the
            lowest index of its largest logit, as ``torch.argmax``.
        top_k (int, Tensor or None): keep the ``k`` largest logits (those tied with the k-th
            too); 0 or ``None``: all.
        top_p (float, Tensor or None): keep the fewest largest tokens whose probability
            reaches ``top_p`` (ties kept), in :math:`(0, 1]`; 1 or ``None``: all.
        min_p (float, Tensor or None): keep tokens whose probability is at least ``min_p``
            times the largest, in :math:`[0, 1]`; 0 or ``None``: all.
        return_logprobs (bool): also return each drawn token's log-probability, under the
            distribution it was drawn from and under the raw logits.

    A tensor parameter's values are not read on the host (that would wait for the device); in
    ``torch.compile``, pass seeds and positions (and parameters that change) as tensors, which
    do not recompile, where Python numbers become constants of the graph.

    Sharded logits (torch_xla SPMD, torchax arrays on a mesh; a tensor-parallel ``lm_head``'s
    split along the vocabulary, the batch's split too) are sampled where they lie: each device
    runs the kernel on its shard, with its columns' noise, and the rows' thresholds and best
    tokens are reductions across the shards, with no gather of the logits; the tokens are the
    unsharded call's. In eager mode, where the sharding is known; compiled, the kernel runs on
    the whole logits (:ref:`sharded tensors <sharding-limits>`). DTensor logits (placed
    ``Shard(-1)``, ``Shard(0)`` or ``Replicate``) are sampled on each rank's block, with
    collectives for the reductions, and give ``(B,)`` DTensors placed as their rows. ``seeds``,
    ``positions`` and the parameters may be DTensors too (not ``Partial``): their values are
    read whole (a replicated one's local tensor; a sharded one gathered, a ``(B,)`` collective).

    Returns:
        Tensor: int64 ``(B,)`` token ids on logits' device (torchax's int64, which is int32
        where JAX runs without x64). With ``return_logprobs=True``, a named tuple
        ``(tokens, logprobs, raw_logprobs)``, the last two float32 ``(B,)``: ``logprobs`` under
        ``softmax(logits / temperature)`` over the kept set (vLLM's ``processed_logprobs``; 0 for
        a greedy row, which draws its token with probability 1) and ``raw_logprobs``,
        ``log_softmax(logits)`` at the token (vLLM's ``raw_logprobs``). They are values, equal
        across batches and devices to within float32 rounding; the tokens are equal bit for bit
        (:func:`torch_pallas.kernels.token_sampling.token_logprobs`).

    Raises:
        TypeError: logits not a float tensor, seeds or positions not integers, a parameter of
            the wrong type.
        ValueError: logits not 2-D or their vocabulary too large, seeds, positions or a
            parameter tensor not of shape ``(B,)``, a seed or position out of range,
            ``temperature < 0``, ``top_k < 0``, ``top_p`` outside :math:`(0, 1]`, ``min_p``
            outside :math:`[0, 1]`, sharded logits that do not split evenly (SPMD) or a
            ``Partial`` DTensor (logits or a per-row argument).

    Example::

        >>> tokens = torch_pallas.sample_tokens(logits, seeds=[7, 8], positions=[0, 12], temperature=0.8, top_p=0.95)
        >>> tokens, logprobs, raw_logprobs = torch_pallas.sample_tokens(logits, [7, 8], [0, 12], return_logprobs=True)
    """
    if not isinstance(return_logprobs, bool):
        raise TypeError(f"return_logprobs must be a bool, got {type(return_logprobs).__name__} {return_logprobs!r}")
    _checks.check_float_tensor(logits, "logits", _LOGITS_DTYPES, dtensors=True)
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D, (batch, vocabulary), got shape {tuple(logits.shape)}")
    batch, vocabulary = logits.shape
    if not 0 < vocabulary < token_sampling_kernels.MAX_VOCABULARY:
        raise ValueError(f"logits' vocabulary (dim 1) must be in [1, 2**20), got {vocabulary}")
    on_ranks = bridge.is_dtensor(logits)
    if on_ranks:
        layout = dtensors.rows_and_vocabulary(logits)
        sharding_text = None
    else:
        # Eager only (sharding.resolve): compiled, the kernel runs on the whole logits.
        logits_sharding = sharding.resolve(logits)
        sharding_text = None if logits_sharding is None else logits_sharding.check(tuple(logits.shape), "logits")
    device = logits.device
    seed_words = _words(seeds, "seeds", batch, device, seed_module.SEED_BOUND, words=2)
    position_words = _words(positions, "positions", batch, device, _POSITION_BOUND, words=1)[:, 0]
    temperature = _per_row(temperature, "temperature", batch, device, integer=False, low=0, high=float("inf"),
                           low_open=False, off=None)
    top_k = _per_row(top_k, "top_k", batch, device, integer=True, low=0, high=float("inf"), low_open=False, off=0)
    top_p = _per_row(top_p, "top_p", batch, device, integer=False, low=0, high=1, low_open=True, off=1)
    min_p = _per_row(min_p, "min_p", batch, device, integer=False, low=0, high=1, low_open=False, off=0)
    if top_k is not None:
        top_k = torch.clamp(top_k, max=vocabulary)
    if logits.dtype == torch.float16:  # Mosaic has no float16: its values are float32's exactly
        logits = logits.float()
    if on_ranks:
        return _sample_on_ranks(logits, (seed_words, position_words, temperature, top_k, top_p, min_p), layout,
                                return_logprobs)
    arguments = (logits, seed_words, position_words, temperature, top_k, top_p, min_p, sharding_text)
    if return_logprobs:
        tokens, logprobs, raw_logprobs = token_sampling_ops.sample_tokens_with_logprobs(*arguments)
        return SampledTokens(tokens.to(torch.int64), logprobs, raw_logprobs)
    return token_sampling_ops.sample_tokens(*arguments).to(torch.int64)


# Its steps are calls and collectives of their own, which dynamo cannot trace (it failed inside the
# bridge's dlpack call, 2026-12-04): a compiled region runs this eagerly, between its graphs.
@torch.compiler.disable
def _sample_on_ranks(logits, per_row: tuple, layout: tuple, return_logprobs: bool):
    """:func:`sample_tokens` of DTensor ``logits``: each rank samples its block's rows from its
    columns (:func:`torch_pallas.ops.token_sampling.sample_local_shard`), the results placed
    as the rows are (``layout``: :func:`torch_pallas.dtensors.rows_and_vocabulary`'s)."""
    rows, vocabulary_offset, groups, placements = layout
    local = logits.to_local()
    per_row = [None if value is None else value[rows] for value in per_row]
    if local.shape[0] == 0:
        results = (local.new_empty((0,), dtype=torch.int32),) + (local.new_empty((0,), dtype=torch.float32),) * 2
    else:
        results = token_sampling_ops.sample_local_shard(local, *per_row, groups=groups,
                                                        vocabulary_offset=vocabulary_offset,
                                                        with_logprobs=return_logprobs)
        results = results if return_logprobs else (results,)
    tokens, *logprobs = [dtensors.placed_rows(result, logits, placements) for result in results]
    tokens = tokens.to(torch.int64)
    return SampledTokens(tokens, *logprobs) if return_logprobs else tokens


class SeededSampling:
    r"""A transformers logits processor that draws each sequence's next token with
    :func:`sample_tokens`, keyed by the sequence's own seed and the number of tokens generated so
    far, so that a prompt's continuation is the same generated alone or in any batch, padded or
    not::

        model.generate(**inputs, do_sample=True, max_new_tokens=32,
                       logits_processor=[torch_pallas.SeededSampling(seeds=[11, 12, 13], temperature=0.8, top_p=0.95)])

    It returns scores that are ``-inf`` but at the drawn token (0 there): ``generate``'s own
    choice (``do_sample=True``'s warpers and ``multinomial``, or ``do_sample=False``'s argmax)
    then takes that token. transformers runs the processors it builds from its own arguments
    (repetition penalty, forced tokens) before the ones given, and its warpers after: give the
    sampling parameters here; ``generate``'s temperature, top-k and top-p then change nothing.

    Args:
        seeds (sequence of ints or Tensor): one per sequence of the batch ``generate`` runs
            (with ``num_return_sequences`` or beams, one per expanded sequence).
        temperature, top_k, top_p, min_p: as :func:`sample_tokens` takes them.

    The position of a token is the number of tokens this processor has drawn in the current
    ``generate`` call: a call whose sequences are not longer than the last it saw starts again at
    0, so one processor serves one ``generate`` call at a time.
    """

    def __init__(self, seeds, *, temperature=1.0, top_k=None, top_p=None, min_p=None):
        self.seeds = seeds
        self.parameters = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        self._start = self._last = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        length = input_ids.shape[1]
        if self._last is None or length <= self._last:
            self._start = length
        self._last = length
        batch = scores.shape[0]
        position = length - self._start
        positions = torch.full((batch,), position, dtype=torch.int64, device=scores.device)
        tokens = sample_tokens(scores, self.seeds, positions, **self.parameters)
        chosen = torch.full_like(scores, -float("inf"))
        return chosen.scatter_(1, tokens[:, None].to(torch.int64), 0.0)
