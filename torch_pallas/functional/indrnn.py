"""``torch_pallas.indrnn``: the IndRNN recurrence, h_t = act(x_t + w * h_{t-1})."""

from __future__ import annotations

import torch

from torch_pallas import _checks
from torch_pallas.ops import indrnn as indrnn_op

NONLINEARITIES = ("relu", "tanh")


def indrnn(x: torch.Tensor, weight: torch.Tensor, h0: torch.Tensor | None = None, *, nonlinearity: str = "relu",
           batch_first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Runs the IndRNN recurrence :math:`h_t = \sigma(x_t + w \odot h_{t-1})` over a sequence.

    Every feature has its own recurrent weight, so the recurrence is elementwise: one Pallas
    kernel carries each (batch, feature) block's state in fast memory across all time steps,
    and a second runs the backward pass in reverse time from the saved outputs. ``x`` is the
    already-projected input (see :class:`torch_pallas.nn.IndRNN` for the full layer).

    Args:
        x (Tensor): ``(T, B, F)``, or ``(B, T, F)`` with ``batch_first``; float32, bfloat16
            or float16, on an XLA device.
        weight (Tensor): ``(F,)`` recurrent weights, a float dtype.
        h0 (Tensor, optional): ``(B, F)`` initial state; zeros if ``None``.
        nonlinearity (str): ``"relu"`` (default) or ``"tanh"``.
        batch_first (bool): whether ``x`` and ``output`` are ``(B, T, F)``.

    Returns:
        (Tensor, Tensor): ``output`` (x's shape and dtype: every :math:`h_t`) and ``h_n``
        ``(B, F)`` in x's dtype. The state is carried and accumulated in float32.

    Raises:
        TypeError: a non-tensor or a non-float tensor (integer dtypes included).
        ValueError: ``x`` not 3-D, ``weight`` not ``(F,)``, ``h0`` not ``(B, F)``, an
            unknown ``nonlinearity``, or a tensor not on an XLA device.

    Example::

        >>> x = torch.randn(100, 8, 256, device=torch_xla.device(), requires_grad=True)
        >>> w = torch.rand(256, device=torch_xla.device(), requires_grad=True)
        >>> output, h_n = torch_pallas.indrnn(x, w)
        >>> output.sum().backward()
    """
    if nonlinearity not in NONLINEARITIES:
        raise ValueError(f"nonlinearity must be 'relu' or 'tanh', got {nonlinearity!r}")
    _checks.check_float_tensor(x, "x")
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
    output, h_n = indrnn_op.indrnn(time_major.contiguous(), weight, h0, nonlinearity)
    return (output.transpose(0, 1) if batch_first else output), h_n
