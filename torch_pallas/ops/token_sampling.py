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


def _sample(logits, seed_words, positions, temperature, top_k, top_p, min_p, *, with_logprobs: bool):
    given = {name: value for name, value in zip(OPTIONAL_PARAMETERS, (top_k, top_p, min_p)) if value is not None}
    if logits.shape[0] == 0:
        tokens = torch.empty((0,), dtype=torch.int32, device=logits.device)
        empty = torch.empty((0,), dtype=torch.float32, device=logits.device)
        return (tokens, empty, empty.clone()) if with_logprobs else tokens
    return bridge.call(_jax_sample_tokens, logits, seed_words, positions, temperature, *given.values(),
                       present=tuple(given), with_logprobs=with_logprobs)


def _compute_sample_tokens(logits: torch.Tensor, seed_words: torch.Tensor, positions: torch.Tensor,
                           temperature: torch.Tensor, top_k: Optional[torch.Tensor], top_p: Optional[torch.Tensor],
                           min_p: Optional[torch.Tensor]) -> torch.Tensor:
    """int32 ``(B,)`` tokens; arguments pre-checked and on logits' device: int32 ``(B, 2)``
    seed words, int32 ``(B,)`` positions, float32 ``(B,)`` temperature, top_p and min_p, int32
    ``(B,)`` top_k (``None``: that parameter off for every row)."""
    return _sample(logits, seed_words, positions, temperature, top_k, top_p, min_p, with_logprobs=False)


def _compute_sample_tokens_with_logprobs(
        logits: torch.Tensor, seed_words: torch.Tensor, positions: torch.Tensor, temperature: torch.Tensor,
        top_k: Optional[torch.Tensor], top_p: Optional[torch.Tensor],
        min_p: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``sample_tokens``' tokens and their float32 ``(B,)`` processed and raw log-probabilities
    (:func:`torch_pallas.kernels.token_sampling.token_logprobs`)."""
    return _sample(logits, seed_words, positions, temperature, top_k, top_p, min_p, with_logprobs=True)


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
