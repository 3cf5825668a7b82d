"""Packed sequences on XLA devices: the padded batch the IndRNN kernels run on, and a
``pack_padded_sequence`` that is right on XLA tensors.

torch_xla 2.9's ``torch.nn.utils.rnn.pack_padded_sequence`` (so also ``pack_sequence``)
returns wrong data for XLA tensors, without an error: its ``_pack_padded_sequence`` reads
every time step after the first from the wrong offset. Here packing and unpacking are one
gather over the flattened ``(T, B)`` positions, built on the CPU from ``batch_sizes``.
"""

from __future__ import annotations

import torch
from torch.nn.utils.rnn import PackedSequence

__all__ = ["pack_padded_sequence", "Padded", "reverse_each"]


def _positions(batch_sizes: torch.Tensor, device) -> torch.Tensor:
    """Flat ``t * B + b`` indices of the packed elements, in packed order."""
    batch = int(batch_sizes[0]) if len(batch_sizes) else 0
    present = torch.arange(batch).unsqueeze(0) < batch_sizes.unsqueeze(1)  # (T, B)
    return present.flatten().nonzero().squeeze(1).to(device)


def pack_padded_sequence(input: torch.Tensor, lengths, batch_first: bool = False,
                         enforce_sorted: bool = True) -> PackedSequence:
    r"""Packs a padded batch of sequences of different lengths, as
    :func:`torch.nn.utils.rnn.pack_padded_sequence`, with data that is right on XLA tensors.

    Args:
        input (Tensor): ``(T, B, *)``, or ``(B, T, *)`` with ``batch_first``; any device.
        lengths (Tensor or list of int): ``(B,)`` lengths in :math:`[1, T]` (a CPU tensor
            or a list: they fix the packed shape).
        batch_first (bool): whether ``input`` is batch first.
        enforce_sorted (bool): if ``True``, ``lengths`` must be in decreasing order;
            if ``False`` the batch is sorted here and the order kept in ``sorted_indices``.

    Returns:
        PackedSequence: the same ``data``, ``batch_sizes`` and indices as torch's function
        computes on the CPU, differentiable with respect to ``input``.

    Raises:
        ValueError: ``lengths`` not ``(B,)``, outside :math:`[1, T]`, or not decreasing
            with ``enforce_sorted``.
    """
    lengths = torch.as_tensor(lengths, dtype=torch.int64, device="cpu")
    time_major = input.transpose(0, 1) if batch_first else input
    steps, batch = time_major.shape[:2]
    if lengths.shape != (batch,):
        raise ValueError(f"lengths must have shape ({batch},), one per sequence, got {tuple(lengths.shape)}")
    if batch and not (int(lengths.min()) >= 1 and int(lengths.max()) <= steps):
        raise ValueError(f"lengths must be in [1, {steps}], got {lengths.tolist()}")
    if enforce_sorted:
        if (lengths[1:] > lengths[:-1]).any():
            raise ValueError(f"lengths must be in decreasing order with enforce_sorted=True, got {lengths.tolist()}; "
                             "pass enforce_sorted=False to sort them here")
        sorted_indices = None
    else:
        lengths, sorted_indices = torch.sort(lengths, descending=True)
        time_major = time_major.index_select(1, sorted_indices.to(input.device))
        sorted_indices = sorted_indices.to(input.device)
    longest = int(lengths[0]) if batch else 0
    batch_sizes = (lengths.unsqueeze(0) > torch.arange(longest).unsqueeze(1)).sum(1)
    flat = time_major[:longest].reshape(longest * batch, *time_major.shape[2:])
    return PackedSequence(flat.index_select(0, _positions(batch_sizes, input.device)), batch_sizes, sorted_indices)


class Padded:
    """A :class:`PackedSequence` as a zero-padded time-major batch in its sorted order
    (``padded()``, with ``lengths`` on the CPU), and a padded result packed back alike."""

    def __init__(self, packed: PackedSequence):
        self.data, self.batch_sizes = packed.data, packed.batch_sizes
        self.sorted_indices, self.unsorted_indices = packed.sorted_indices, packed.unsorted_indices
        batch_sizes = packed.batch_sizes.to("cpu", torch.int64)
        self.steps, self.batch = len(batch_sizes), int(batch_sizes[0]) if len(batch_sizes) else 0
        self.lengths = (batch_sizes.unsqueeze(0) > torch.arange(self.batch).unsqueeze(1)).sum(1)
        self.positions = _positions(batch_sizes, packed.data.device)

    def padded(self) -> torch.Tensor:
        features = self.data.shape[1:]
        flat = self.data.new_zeros(self.steps * self.batch, *features).index_copy(0, self.positions, self.data)
        return flat.view(self.steps, self.batch, *features)

    def packed(self, padded: torch.Tensor) -> PackedSequence:
        data = padded.reshape(self.steps * self.batch, *padded.shape[2:]).index_select(0, self.positions)
        return PackedSequence(data, self.batch_sizes, self.sorted_indices, self.unsorted_indices)


def reverse_each(sequence: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """Time-major ``sequence`` with each sequence's first ``lengths[b]`` steps reversed and
    its padding left in place (its own inverse); all of time reversed without lengths."""
    if lengths is None:
        return sequence.flip(0)
    steps = torch.arange(sequence.shape[0], device=sequence.device).unsqueeze(1)
    source = torch.where(steps < lengths, lengths - 1 - steps, steps)
    return sequence.gather(0, source.unsqueeze(-1).expand_as(sequence))
