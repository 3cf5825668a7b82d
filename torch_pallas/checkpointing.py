"""Activation checkpointing whose recomputation draws exactly its forward's noise."""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import _get_current_function_mode_stack
import torch_xla.utils.checkpoint as xla_checkpoint

from torch_pallas import seeds
from torch_pallas.routing import route_dropout

__all__ = ["checkpoint"]


def _device_of(args) -> torch.device | None:
    return next((arg.device for arg in args if isinstance(arg, torch.Tensor) and arg.device.type == "xla"), None)


def _active_routing() -> route_dropout | None:
    modes = [mode for mode in _get_current_function_mode_stack() if isinstance(mode, route_dropout)]
    return modes[-1] if modes else None


# Dynamo would compile this frame and guard on ``function``'s identity: Hugging Face passes
# a new functools.partial per call, so every step would recompile. The region runs as
# torch_xla's checkpoint runs it under compile anyway: outside dynamo, as lazy tensors.
@torch.compiler.disable
def checkpoint(function, *args, use_reentrant: bool | None = None, preserve_rng_state: bool = True, **kwargs):
    r"""Checkpoints ``function(*args, **kwargs)``: its activations are recomputed in the
    backward pass instead of stored, and every torch_pallas random op inside draws the
    same noise in the recomputation as in the forward, in eager mode and under
    ``torch.compile(backend="openxla")``.

    Takes :func:`torch.utils.checkpoint.checkpoint`'s arguments, so it can be given to
    Hugging Face models (``model._set_gradient_checkpointing(True,
    gradient_checkpointing_func=torch_pallas.checkpoint)``). One key is drawn from the XLA
    RNG (or the enclosing :func:`torch_pallas.seeds.key_scope`) before the region runs,
    and the region runs in a :func:`~torch_pallas.seeds.key_scope` of it (and in the
    caller's :func:`torch_pallas.route_dropout`, re-entered for the recomputation): its ``i``-th
    random op without a seed uses ``jax.random.fold_in(key, i)``, a pure function of an
    input of the region, so no RNG state can make the recomputation drift. The
    checkpointing itself is ``torch_xla.utils.checkpoint.checkpoint`` (reentrant, with
    the optimisation barrier XLA needs so that the recomputation is not merged with the
    forward). Under ``torch.compile`` the region is a graph break: it runs as lazy XLA
    tensors (traced and compiled by torch_xla, cached across steps), the rest of the
    model compiled.

    Args:
        function: the region; takes ``*args`` and ``**kwargs``, returns tensors.
        *args: its positional arguments. As with any reentrant checkpoint, gradients flow
            to parameters used inside only if at least one tensor in ``args`` requires grad.
        use_reentrant (bool, optional): ``None`` or ``True``; torch_xla 2.9 has only the
            reentrant implementation.
        preserve_rng_state (bool): also restore the XLA RNG before recomputing, for random
            ops that are not torch_pallas's (torch's own dropout, say). Default: ``True``.
        **kwargs: keyword arguments for ``function``.

    Returns:
        What ``function`` returns.

    Raises:
        ValueError: ``use_reentrant=False``.
        TypeError: ``function`` is not callable.
    """
    if not callable(function):
        raise TypeError(f"function must be callable, got {type(function).__name__}")
    if use_reentrant is False:
        raise ValueError("use_reentrant=False is not available on XLA (torch_xla 2.9 checkpoints "
                         "reentrantly only): pass use_reentrant=True or leave it out")
    key_data = seeds.key_data(device=_device_of(args))
    routing = _active_routing()

    def region(key_data, *args):
        # The recomputation runs in backward, outside the caller's route_dropout scope:
        # re-enter it, or the recomputed F.dropout calls would be torch's, with other masks.
        reentered = routing if routing is not None and _active_routing() is None else contextlib.nullcontext()
        with seeds.key_scope(key_data), reentered:
            return function(*args, **kwargs)

    return xla_checkpoint.checkpoint(region, key_data, *args, preserve_rng_state=preserve_rng_state)
