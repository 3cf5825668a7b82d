"""Modules: :class:`Dropout`, a drop-in :class:`torch.nn.Dropout`, and :func:`convert_dropout`."""

from __future__ import annotations

import torch

from torch_pallas import _checks
from torch_pallas.functional import dropout as dropout_fn

__all__ = ["Dropout", "convert_dropout"]


class Dropout(torch.nn.Module):
    r"""During training, zeroes elements with probability ``p`` and scales the rest by :math:`1/(1-p)`.

    A drop-in for :class:`torch.nn.Dropout` on XLA devices: each call draws a fresh key from
    the XLA RNG (reproducible after ``torch_xla.manual_seed``), and the backward pass
    regenerates the mask from that 8-byte key instead of storing it. In ``eval()`` mode
    it returns its input. See :func:`torch_pallas.dropout`.

    Args:
        p (float): probability of an element being zeroed, in :math:`[0, 1]`. Default: 0.5.
        impl (str, optional): ``"threefry"`` or ``"hardware"`` (TPU only); default per platform.

    Shape:
        - Input: any shape, float32, bfloat16 or float16, on an XLA device.
        - Output: the input's shape and dtype.

    Raises:
        ValueError: ``p`` outside :math:`[0, 1]` or NaN, an unknown ``impl``, or
            ``impl="hardware"`` off TPU.
    """

    def __init__(self, p: float = 0.5, *, impl=None):
        super().__init__()
        self.p = _checks.check_probability(p)
        _checks.resolve_impl(impl)
        self.impl = impl

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return dropout_fn(input, self.p, self.training, impl=self.impl)

    def extra_repr(self) -> str:
        return f"p={self.p}" + (f", impl={self.impl!r}" if self.impl is not None else "")


def convert_dropout(model: torch.nn.Module, *, impl=None) -> torch.nn.Module:
    """Replaces every :class:`torch.nn.Dropout` in ``model`` (nested too) with :class:`Dropout`.

    Each replacement keeps the original's ``p`` and training mode. ``Dropout1d/2d/3d`` and
    ``AlphaDropout`` (different semantics) are left alone, as are subclasses of
    ``nn.Dropout``. ``inplace=True`` is dropped: the replacement never works in place.

    Args:
        model (nn.Module): converted in place.
        impl (str, optional): passed to every new :class:`Dropout`.

    Returns:
        nn.Module: ``model``, or a new :class:`Dropout` if ``model`` itself is an ``nn.Dropout``.
    """
    _checks.resolve_impl(impl)
    if type(model) is torch.nn.Dropout:
        return _replacement(model, impl)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Dropout:
                setattr(parent, name, _replacement(child, impl))
    return model


def _replacement(module: torch.nn.Dropout, impl) -> Dropout:
    replacement = Dropout(module.p, impl=impl)
    replacement.train(module.training)
    return replacement
