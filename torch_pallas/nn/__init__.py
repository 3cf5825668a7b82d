"""Modules: :class:`Dropout` (a drop-in :class:`torch.nn.Dropout`), its channel variants,
:func:`convert_dropout`, and :class:`IndRNN` (as :class:`torch.nn.RNN`)."""

from torch_pallas.nn.dropout import Dropout, Dropout1d, Dropout2d, Dropout3d, convert_dropout
from torch_pallas.nn.rnn import IndRNN

__all__ = ["Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "IndRNN", "convert_dropout"]
