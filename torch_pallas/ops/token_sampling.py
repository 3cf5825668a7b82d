"""``torch_pallas::sample_tokens``: one token per row of logits, by the contract of
:mod:`torch_pallas.kernels.token_sampling`."""

from __future__ import annotations

from typing import Optional

import torch

from torch_pallas import bridge
from torch_pallas.kernels import token_sampling as token_sampling_kernels
from torch_pallas.ops import _autograd

# The optional per-row parameters, in the order the op takes them.
OPTIONAL_PARAMETERS = ("top_k", "top_p", "min_p")


def _jax_sample_tokens(logits, seed_words, positions, temperature, *given, present, with_logprobs, interpret):
    parameters = dict(zip(present, given))
    return token_sampling_kernels.sample_tokens(logits, seed_words, positions, temperature, interpret=interpret,
                                                with_logprobs=with_logprobs, **parameters)


def _jax_sampling_rows(logits, seed_words, positions, temperature, *given, present, interpret):
    del interpret  # no kernel: XLA's partitioner splits these reductions along the logits' sharding
    return token_sampling_kernels.sampling_rows(logits, seed_words, positions, temperature,
                                                **dict(zip(present, given)))


def _jax_best_of_shards(tokens, scores, *, interpret):
    del interpret
    along_shards = token_sampling_kernels.InTrace(token_sampling_kernels.along_last_axis)
    return token_sampling_kernels.best_of_shards(tokens, scores, along_shards)[:, 0]


def _jax_token_logprobs(logits, tokens, temperature, rows, *, interpret):
    del interpret
    return token_sampling_kernels.token_logprobs(logits, tokens, temperature,
                                                 token_sampling_kernels.threshold_of(rows))


def _sample_sharded(logits, seed_words, positions, temperature, given: dict, sharding_text: str, with_logprobs: bool):
    """The sampler on logits sharded as ``sharding_text`` says (the vocabulary, the batch or
    both split), with no gather of them: the thresholds' reductions as XLA partitions them (exact:
    maxima and integer sums), the Gumbel-max kernel on each device's shard (the noise of its
    columns' indices in the whole vocabulary), and each row's best of its shards' tokens."""
    rows = bridge.call(_jax_sampling_rows, logits, seed_words, positions, temperature, *given.values(),
                       present=tuple(given))
    dims = (0, 1)
    tokens, scores = bridge.call_sharded(token_sampling_kernels.gumbel_max_of_shard, sharding_text, [rows, logits],
                                         [(0, None), dims], [dims, dims], noise_shape=tuple(logits.shape),
                                         shared_over_first_dim=True)
    tokens = bridge.call(_jax_best_of_shards, tokens, scores)
    if not with_logprobs:
        return tokens
    return (tokens, *bridge.call(_jax_token_logprobs, logits, tokens, temperature, rows))


def _sample(logits, seed_words, positions, temperature, top_k, top_p, min_p, sharding_text, *, with_logprobs: bool):
    given = {name: value for name, value in zip(OPTIONAL_PARAMETERS, (top_k, top_p, min_p)) if value is not None}
    if logits.shape[0] == 0:
        tokens = torch.empty((0,), dtype=torch.int32, device=logits.device)
        empty = torch.empty((0,), dtype=torch.float32, device=logits.device)
        return (tokens, empty, empty.clone()) if with_logprobs else tokens
    if sharding_text is not None:
        return _sample_sharded(logits, seed_words, positions, temperature, given, sharding_text, with_logprobs)
    return bridge.call(_jax_sample_tokens, logits, seed_words, positions, temperature, *given.values(),
                       present=tuple(given), with_logprobs=with_logprobs)


def _compute_sample_tokens(logits: torch.Tensor, seed_words: torch.Tensor, positions: torch.Tensor,
                           temperature: torch.Tensor, top_k: Optional[torch.Tensor], top_p: Optional[torch.Tensor],
                           min_p: Optional[torch.Tensor], sharding_text: Optional[str] = None) -> torch.Tensor:
    """int32 ``(B,)`` tokens; arguments pre-checked and on logits' device: int32 ``(B, 2)``
    seed words, int32 ``(B,)`` positions, float32 ``(B,)`` temperature, top_p and min_p, int32
    ``(B,)`` top_k (``None``: that parameter off for every row). ``sharding_text`` (the text of
    the logits' :class:`~torch_pallas.sharding.Sharding`): the kernel runs on each device's
    shard (:func:`_sample_sharded`)."""
    return _sample(logits, seed_words, positions, temperature, top_k, top_p, min_p, sharding_text,
                   with_logprobs=False)


def _compute_sample_tokens_with_logprobs(
        logits: torch.Tensor, seed_words: torch.Tensor, positions: torch.Tensor, temperature: torch.Tensor,
        top_k: Optional[torch.Tensor], top_p: Optional[torch.Tensor], min_p: Optional[torch.Tensor],
        sharding_text: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``sample_tokens``' tokens and their float32 ``(B,)`` processed and raw log-probabilities
    (:func:`torch_pallas.kernels.token_sampling.token_logprobs`)."""
    return _sample(logits, seed_words, positions, temperature, top_k, top_p, min_p, sharding_text,
                   with_logprobs=True)


def _jax_step(*arrays, step, interpret, **static):
    del interpret  # the steps are plain JAX; the Gumbel-max kernel runs through _jax_gumbel_max
    return step(*arrays, **static)


def _jax_gumbel_max(rows, logits, *, vocabulary_offset: int, interpret):
    return token_sampling_kernels.gumbel_max(logits, rows, interpret=interpret, vocabulary_offset=vocabulary_offset)


_COLLECTIVES = {"max": "MAX", "min": "MIN", "sum": "SUM"}


class AcrossRanks:
    """:class:`torch_pallas.kernels.token_sampling.InTrace`'s interface on a DTensor's local
    shard of logits: each step a call of its own on this rank's tensors, the partials all-reduced
    over ``groups`` (the process groups of the mesh dims that split the vocabulary; none: the
    rank holds whole rows). Every rank of a group runs the same steps, so their collectives pair
    up. Integer partials are reduced in int64, which holds the uint32 keys and sums exactly."""

    def __init__(self, groups):
        self.groups = tuple(groups)

    def apply(self, function, *tensors, **static):
        return bridge.call(_jax_step, *tensors, step=function, **static)

    def reduce(self, kind: str, partial):
        if not self.groups:
            return partial
        parts = partial if isinstance(partial, tuple) else (partial,)
        floating = parts[0].dtype.is_floating_point
        if any(x.dtype.is_floating_point != floating for x in parts):
            return tuple(self.reduce(kind, x) for x in parts)
        # One collective for a tuple's partials (top-p's mass digits: one per search step, not three), stacked:
        # a copy, as all_reduce writes in place and a partial (a shard's scores) is read again.
        wide = torch.stack([x.to(torch.float32 if floating else torch.int64) for x in parts])
        for group in self.groups:
            torch.distributed.all_reduce(wide, op=getattr(torch.distributed.ReduceOp, _COLLECTIVES[kind]), group=group)
        reduced = tuple(row.to(x.dtype) for row, x in zip(wide, parts))
        return reduced if isinstance(partial, tuple) else reduced[0]

    def bisect(self, partial, kind, holds, shard_arguments, row_arguments):
        return token_sampling_kernels.bisect_in_steps(self, partial, kind, holds, shard_arguments, row_arguments)


def sample_local_shard(logits, seed_words, positions, temperature, top_k, top_p, min_p, *, groups,
                       vocabulary_offset: int, with_logprobs: bool):
    """The sampler on one rank's block of a DTensor of logits (its rows' arguments as
    :func:`_compute_sample_tokens` takes them; its first column is entry ``vocabulary_offset`` of
    the vocabulary, split over ``groups``): the whole rows' tokens (and log-probabilities), as
    the unsharded call gives them, the reductions across ranks by :class:`AcrossRanks`.
    Runs eagerly: each step is a call and each reduction a collective of its own."""
    steps = AcrossRanks(groups)
    rows = token_sampling_kernels.sampling_rows(logits, seed_words, positions, temperature, top_k, top_p, min_p,
                                                steps=steps)
    tokens, scores = bridge.call(_jax_gumbel_max, rows, logits, vocabulary_offset=vocabulary_offset)
    tokens = token_sampling_kernels.best_of_shards(tokens, scores, steps)
    if not with_logprobs:
        return tokens
    threshold = steps.apply(token_sampling_kernels.threshold_of, rows)
    return (tokens, *token_sampling_kernels.token_logprobs(logits, tokens, temperature, threshold,
                                                           vocabulary_offset=vocabulary_offset, steps=steps))


sample_tokens_op = torch.library.custom_op("torch_pallas::sample_tokens", _compute_sample_tokens, mutates_args=())
sample_tokens = _autograd.direct(sample_tokens_op, _compute_sample_tokens)
sample_tokens_with_logprobs_op = torch.library.custom_op("torch_pallas::sample_tokens_with_logprobs",
                                                         _compute_sample_tokens_with_logprobs, mutates_args=())
sample_tokens_with_logprobs = _autograd.direct(sample_tokens_with_logprobs_op, _compute_sample_tokens_with_logprobs)


@sample_tokens_op.register_fake
def _(logits, *parameters):
    return logits.new_empty((logits.shape[0],), dtype=torch.int32)


@sample_tokens_with_logprobs_op.register_fake
def _(logits, *parameters):
    batch = logits.shape[0]
    return (logits.new_empty((batch,), dtype=torch.int32), logits.new_empty((batch,), dtype=torch.float32),
            logits.new_empty((batch,), dtype=torch.float32))
