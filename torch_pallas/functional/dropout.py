"""``torch_pallas.dropout``: dropout that stores an 8-byte key instead of a mask."""

from __future__ import annotations

import torch

from torch_pallas import _checks, seeds
from torch_pallas.ops import dropout as dropout_op


def dropout(x: torch.Tensor, p: float = 0.5, training: bool = True, *, seed=None, generator=None,
            impl=None) -> torch.Tensor:
    r"""Randomly zeroes elements of ``x`` with probability ``p`` and scales the rest by :math:`1/(1-p)`.

    Like :func:`torch.nn.functional.dropout`, but the mask comes from a PRNG key and is
    regenerated in the backward kernel: the autograd graph keeps 8 bytes per call instead
    of a mask as large as ``x``. An element is kept when its float32 uniform number is
    below ``float32(1 - p)``; with ``impl="threefry"`` the mask is bit for bit
    ``jax.random.bernoulli(jax.random.key(seed), 1 - p, x.shape)``, whatever the device or
    the kernels' block sizes.

    Args:
        x (Tensor): float32, bfloat16 or float16, any shape, on an XLA device.
        p (float): probability of an element being zeroed, in :math:`[0, 1]`. ``p == 0``
            returns ``x``; ``p == 1`` returns zeros (with zero gradient).
        training (bool): apply dropout if ``True``; return ``x`` itself if ``False``.
        seed (int, optional): in :math:`[0, 2^{64})`; the same seed gives the same mask.
        generator (torch.Generator, optional): a CPU generator to draw the key from.
            Without ``seed`` or ``generator`` a fresh key is drawn from the XLA device's RNG
            (seeded by ``torch_xla.manual_seed``) on every call.
        impl (str, optional): ``"threefry"`` or ``"hardware"`` (TPU only); default
            ``"hardware"`` on TPU, ``"threefry"`` elsewhere.

    Returns:
        Tensor: same shape and dtype as ``x`` (a new tensor unless ``x`` is returned as is).

    Raises:
        TypeError: ``x`` is not a float tensor (integer and bool tensors are rejected), or
            ``p`` or ``seed`` has the wrong type.
        ValueError: ``p`` outside :math:`[0, 1]` or NaN, a seed outside :math:`[0, 2^{64})`,
            both ``seed`` and ``generator``, an unknown ``impl``, ``impl="hardware"`` off
            TPU, or ``x`` not on an XLA device.

    Example::

        >>> x = torch.randn(4, 128, device=torch_xla.device(), requires_grad=True)
        >>> y = torch_pallas.dropout(x, p=0.1, seed=0)
        >>> y.sum().backward()   # the same mask, regenerated from the key
    """
    return apply_dropout(x, p, training, seed=seed, generator=generator, impl=impl)


def apply_dropout(x, p, training, *, seed=None, generator=None, impl=None, mask_shared_over_first_dim=False):
    """:func:`dropout`, optionally with one mask of shape ``x.shape[1:]`` shared by every
    index of the first dim (for recurrent nets: the same mask at every time step)."""
    _checks.check_float_tensor(x, "x")
    p = _checks.check_probability(p)
    impl = _checks.resolve_impl(impl)
    if seed is not None:
        seeds.check_seed(seed)
    if not training or p == 0.0:
        return x
    if p == 1.0:
        return x.masked_fill(torch.ones((), dtype=torch.bool, device=x.device), 0.0)
    key = seeds.key_data(seed=seed, generator=generator, device=x.device)
    return dropout_op.dropout(x, key, p, impl, mask_shared_over_first_dim, [], [])
