"""The public differentiable functions: :func:`dropout` and :func:`indrnn`."""

from __future__ import annotations

import torch

from torch_pallas import _checks, seeds
from torch_pallas.kernels.indrnn import check_nonlinearity
from torch_pallas.ops import dropout as dropout_op, indrnn as indrnn_op

__all__ = ["dropout", "indrnn"]


def dropout(x: torch.Tensor, p: float = 0.5, training: bool = True, *, seed=None, generator=None, impl=None,
            shared_over_first_dim: bool = False) -> torch.Tensor:
    r"""Randomly zeroes elements of ``x`` with probability ``p`` and scales the rest by :math:`1/(1-p)`.

    Like :func:`torch.nn.functional.dropout`, but the mask comes from a PRNG key and is
    regenerated in the backward kernel: the autograd graph keeps 8 bytes per call instead
    of a mask as large as ``x``. An element is kept when its float32 uniform number is
    below ``float32(1 - p)``; with ``impl="threefry"`` the mask is bit for bit
    ``jax.random.bernoulli(jax.random.key(seed), 1 - p, x.shape)``, whatever the device or
    the kernels' block sizes.

    Args:
        x (Tensor): float32, bfloat16 or float16, any shape, on an XLA device (any tensor
            when nothing is dropped: ``training=False`` or ``p == 0``).
        p (float): probability of an element being zeroed, in :math:`[0, 1]`. ``p == 0``
            returns ``x``; ``p == 1`` returns zeros (with zero gradient).
        training (bool): apply dropout if ``True``; return ``x`` itself if ``False``, for
            any device and dtype (the other arguments are checked either way).
        seed (int, optional): in :math:`[0, 2^{64})`; the same seed gives the same mask.
        generator (torch.Generator, optional): a CPU generator to draw the key from.
            Without ``seed`` or ``generator`` a fresh key is drawn from the XLA device's RNG
            (seeded by ``torch_xla.manual_seed``) on every call.
        impl (str, optional): ``"threefry"`` or ``"hardware"`` (TPU only); default
            ``"hardware"`` on TPU, ``"threefry"`` elsewhere.
        shared_over_first_dim (bool): draw one mask of shape ``x.shape[1:]`` and apply it
            at every index of the first dim (for a recurrent net's time-major sequence:
            the same mask at every time step). Default: ``False``.

    Returns:
        Tensor: same shape and dtype as ``x`` (a new tensor unless ``x`` is returned as is).

    Raises:
        TypeError: ``x`` is not a float tensor (integer and bool tensors are rejected), or
            ``p``, ``seed`` or ``generator`` has the wrong type.
        ValueError: ``p`` outside :math:`[0, 1]` or NaN, a seed outside :math:`[0, 2^{64})`,
            both ``seed`` and ``generator``, an unknown ``impl``, ``impl="hardware"`` off
            TPU, ``x`` not on an XLA device, 2**32 or more elements, or
            ``shared_over_first_dim`` with a 0-dim ``x``.

    Example::

        >>> x = torch.randn(4, 128, device=torch_xla.device(), requires_grad=True)
        >>> y = torch_pallas.dropout(x, p=0.1, seed=0)
        >>> y.sum().backward()   # the same mask, regenerated from the key
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    p = _checks.check_probability(p)
    impl = _checks.resolve_impl(impl)
    if shared_over_first_dim and x.dim() == 0:
        raise ValueError("shared_over_first_dim needs an input with at least one dimension")
    if not training or p == 0.0:
        seeds.check_source(seed, generator)  # no key is drawn, but a bad source still raises
        return x  # the identity, as torch's, for any device and dtype
    _checks.check_float_tensor(x, "x")
    _checks.check_numel(x.shape, "x")
    if p == 1.0:
        seeds.check_source(seed, generator)
        return x.masked_fill(torch.ones((), dtype=torch.bool, device=x.device), 0.0)
    key_data = seeds.key_data(seed=seed, generator=generator, device=x.device)
    return dropout_op.apply(x, key_data, p, impl, shared_over_first_dim)


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
    check_nonlinearity(nonlinearity)
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
    output, h_n = indrnn_op.apply(time_major.contiguous(), weight, h0, nonlinearity)
    return (output.transpose(0, 1) if batch_first else output), h_n
