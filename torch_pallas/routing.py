"""Routes torch's functional dropout to torch_pallas inside a scope, so dropouts that are
not ``nn.Dropout`` modules (``F.dropout`` calls in a model's forward) are reached too."""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from torch_pallas import _checks, bridge
from torch_pallas import functional

__all__ = ["route_dropout"]

# torch's function -> (its signature, to bind calls; ours, with the same leading parameters)
_DROPOUTS = {
    F.dropout: (inspect.signature(F.dropout), functional.dropout),
    torch.dropout: (inspect.signature(lambda input, p, train: None), functional.dropout),
    F.dropout1d: (inspect.signature(F.dropout1d), functional.dropout1d),
    F.dropout2d: (inspect.signature(F.dropout2d), functional.dropout2d),
    F.dropout3d: (inspect.signature(F.dropout3d), functional.dropout3d),
}
_SDPA_WARNING = ("torch_pallas.route_dropout: scaled_dot_product_attention's dropout_p is applied inside "
                 "torch's attention kernel with torch's RNG and is not routed to torch_pallas")


class route_dropout(TorchFunctionMode):
    r"""Within it, ``torch.nn.functional.dropout``, ``torch.dropout`` (and so every
    ``torch.nn.Dropout`` module) on float tensors on an XLA device or the CPU run as
    :func:`torch_pallas.dropout`, and ``F.dropout1d/2d/3d`` (``nn.Dropout1d/2d/3d``) as
    their torch_pallas counterparts.

    A :class:`torch.overrides.TorchFunctionMode`: it works in eager mode and under
    ``torch.compile(backend="openxla")`` (dynamo traces the mode), entered around the
    compiled call or inside the compiled function. Calls on other devices, or on tensors
    that are not floating point, go to torch unchanged. Keys come from the RNG of the
    input's device (or the enclosing :func:`torch_pallas.seeds.key_scope`, as inside
    :func:`torch_pallas.checkpoint`).
    Dropout inside ``F.scaled_dot_product_attention(..., dropout_p > 0)`` cannot be
    routed: a warning says so (once per call site).

    Args:
        impl (str, optional): ``"threefry"`` or ``"hardware"`` (TPU only); default
            :func:`torch_pallas.random.get_default_impl` (``"threefry"`` unless changed).

    Raises:
        ValueError: an unknown ``impl``, or ``"hardware"`` off TPU.

    Example::

        >>> with torch_pallas.route_dropout():
        ...     loss = model(inputs).loss   # every F.dropout in the model is torch_pallas's
        >>> loss.backward()                  # masks regenerated from their keys
    """

    def __init__(self, *, impl=None):
        super().__init__()
        _checks.resolve_impl(impl)
        self.impl = impl

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _DROPOUTS:
            signature, ours = _DROPOUTS[func]
            call = signature.bind(*args, **kwargs)
            call.apply_defaults()
            input, p, training = call.args[:3]
            if input.is_floating_point() and bridge.runs_on(input.device):
                return ours(input, p, training, call.arguments.get("inplace", False), impl=self.impl)
        elif func is F.scaled_dot_product_attention and kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0):
            # No state kept here, so that dynamo has nothing to guard on and recompile for.
            _checks.warn(_SDPA_WARNING, stacklevel=2)
        return func(*args, **kwargs)
