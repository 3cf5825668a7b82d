"""Activation checkpointing whose recomputation draws exactly its forward's noise: this module's
:func:`checkpoint`, and torch's own checkpoints inside :func:`torch_pallas.route_dropout`
(:func:`_route_torch_checkpoints`)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys

import torch
import torch.utils.checkpoint
from torch.overrides import _get_current_function_mode_stack

from torch_pallas import _checks, bridge, seeds
from torch_pallas.routing import route_dropout

__all__ = ["checkpoint", "enable"]


def _device_of(args) -> torch.device:
    """Where the region's key is drawn: the first tensor argument's device (a CPU region's key
    on the CPU), or the stack's default device."""
    return next((arg.device for arg in args if isinstance(arg, torch.Tensor) and bridge.runs_on(arg.device)),
                None) or bridge.device_or_default()


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
    Hugging Face models: ``torch_pallas.checkpoint.enable(model)`` (:func:`enable`) is
    their ``model.gradient_checkpointing_enable()`` with this function. One key is drawn
    before the region runs, from the RNG of the first tensor argument's device (the XLA
    RNG; torch's generator for a CPU region) or the enclosing
    :func:`torch_pallas.seeds.key_scope`,
    and the region runs in a :func:`~torch_pallas.seeds.key_scope` of it (and in the
    caller's :func:`torch_pallas.route_dropout`, re-entered for the recomputation): its ``i``-th
    random op without a seed uses ``jax.random.fold_in(key, i)``, a pure function of an
    input of the region, so no RNG state can make the recomputation drift. The
    checkpointing itself is, on XLA tensors, ``torch_xla.utils.checkpoint.checkpoint``
    (reentrant, with the optimisation barrier XLA needs so that the recomputation is not
    merged with the forward; under ``torch.compile`` the region is a graph break: it runs as
    lazy XLA tensors, traced and compiled by torch_xla, cached across steps, the rest of the
    model compiled), and on torchax and CPU tensors ``torch.utils.checkpoint.checkpoint``
    (under ``jax.grad`` of a torch function, where torch's autograd records nothing, the region
    simply runs: JAX keeps what its own differentiation needs).

    Args:
        function: the region; takes ``*args`` and ``**kwargs``, returns tensors.
        *args: its positional arguments. As with any reentrant checkpoint, gradients flow
            to parameters used inside only if at least one tensor in ``args`` requires grad.
        use_reentrant (bool, optional): ``None`` (reentrant) or ``True``; ``False`` too on
            torchax and CPU tensors, but not on XLA tensors: torch_xla 2.9 has only the
            reentrant implementation.
        preserve_rng_state (bool): also restore the XLA RNG before recomputing, for random
            ops that are not torch_pallas's (torch's own dropout, say). Default: ``True``.
        **kwargs: keyword arguments for ``function``.

    Returns:
        What ``function`` returns.

    Raises:
        ValueError: ``use_reentrant=False`` on XLA tensors.
        TypeError: ``function`` is not callable.
    """
    if not callable(function):
        raise TypeError(f"function must be callable, got {type(function).__name__}")
    device = _device_of(args)
    key_data = seeds.key_data(device=device)
    routing = _active_routing()

    def region(key_data, *args):
        # The recomputation runs in backward, outside the caller's route_dropout scope:
        # re-enter it, or the recomputed F.dropout calls would be torch's, with other masks.
        reentered = routing if routing is not None and _active_routing() is None else contextlib.nullcontext()
        with seeds.key_scope(key_data), reentered:
            return function(*args, **kwargs)

    return bridge.checkpoint(device, region, key_data, *args, use_reentrant=use_reentrant,
                             preserve_rng_state=preserve_rng_state)


def enable(model: torch.nn.Module, *, use_reentrant: bool | None = None,
           preserve_rng_state: bool = True) -> torch.nn.Module:
    r"""Turns on gradient checkpointing in a Hugging Face transformers model, with
    :func:`checkpoint` as its checkpoint function: ``model.gradient_checkpointing_enable()``
    for XLA devices, where that method fails (``torch.utils.checkpoint`` has no XLA
    support: ``module 'torch' has no attribute 'xla'``). Also reached as
    ``torch_pallas.checkpoint.enable(model)``.

    It does what ``PreTrainedModel.gradient_checkpointing_enable`` does in transformers
    4.57: every submodule with a ``gradient_checkpointing`` attribute (each decoder layer,
    say) checkpoints through :func:`checkpoint` when the model is in training mode, so each
    recomputation draws its forward's dropout masks; a model with a PEFT adapter loaded
    or a PEFT ``PeftModel`` (any model whose input embeddings are frozen when this is called)
    gets ``enable_input_require_grads()``, so that gradients reach the adapters through
    frozen layers. ``model.gradient_checkpointing_disable()`` turns it off again as is.

    Args:
        model (transformers.PreTrainedModel): changed in place.
        use_reentrant (bool, optional), preserve_rng_state (bool): passed to every
            :func:`checkpoint` call (``gradient_checkpointing_kwargs`` of the transformers
            method). Default: ``None``, ``True``.

    Returns:
        nn.Module: ``model``.

    Raises:
        TypeError: ``model`` is not a transformers model (it has no
            ``_set_gradient_checkpointing``); for other modules, call :func:`checkpoint`
            in their ``forward``.
        ValueError: the model class does not support gradient checkpointing
            (``supports_gradient_checkpointing`` is ``False``), uses transformers' format
            from before 4.35 (which takes no checkpoint function), or
            ``use_reentrant=False``.

    Example::

        >>> model = transformers.AutoModelForCausalLM.from_config(config).to(torch_xla.device())
        >>> torch_pallas.checkpoint.enable(model)
    """
    setter = getattr(model, "_set_gradient_checkpointing", None)
    if not isinstance(model, torch.nn.Module) or not callable(setter) or not hasattr(
            model, "supports_gradient_checkpointing"):
        raise TypeError(f"model must be a Hugging Face transformers model (a PreTrainedModel), got "
                        f"{type(model).__name__}; in other modules call torch_pallas.checkpoint(function, *args) "
                        "in forward")
    if not model.supports_gradient_checkpointing:
        raise ValueError(f"{type(model).__name__} does not support gradient checkpointing "
                         "(its supports_gradient_checkpointing is False)")
    if "value" in inspect.signature(setter).parameters:
        # transformers falls back to model.apply(partial(setter, value=True)) there, which
        # keeps the model's own torch.utils.checkpoint, the function that fails on XLA
        raise ValueError(f"{type(model).__name__} overrides _set_gradient_checkpointing(module, value), the format "
                         "of transformers < 4.35, which takes no checkpoint function: update its modeling code")
    bridge.check_use_reentrant(use_reentrant)
    setter(enable=True, gradient_checkpointing_func=functools.partial(
        checkpoint, use_reentrant=use_reentrant, preserve_rng_state=preserve_rng_state))
    if _input_embeddings_frozen(model):
        model.enable_input_require_grads()
    return model


def _input_embeddings_frozen(model: torch.nn.Module) -> bool:
    """Whether the model's input embeddings take no gradient: then no region's input would
    require grad, and a reentrant checkpoint would pass no gradient to the trainable
    parameters inside (a LoRA adapter; a PEFT ``PeftModel`` reaches here too, through its
    attribute forwarding to the transformers model)."""
    embeddings = model.get_input_embeddings() if callable(getattr(model, "get_input_embeddings", None)) else None
    weight = getattr(embeddings, "weight", None)
    return isinstance(weight, torch.Tensor) and not weight.requires_grad


checkpoint.enable = enable


class _RoutedRegion:
    """A region that torch's checkpoint (or the stack's) runs inside :func:`route_dropout`, run in
    the forward's routing and in a :func:`~torch_pallas.seeds.key_scope` of one key, drawn at its
    first random op, in its forward and in each recomputation. The recomputation runs in the
    backward pass, where autograd has no ``TorchFunctionMode`` active (it leaves them out of the
    state it runs the backward in): without the routing re-entered, the region's ``F.dropout``
    calls would be torch's, with other masks (and non-reentrant checkpointing finds other saved
    tensors and raises); and with the key scope, each recomputation draws its forward's masks
    whatever RNG state ``preserve_rng_state`` restores."""

    def __init__(self, function, routing: route_dropout):
        self.function, self.routing = function, routing
        self.key = seeds.RegionKey()

    @contextlib.contextmanager
    def scope(self):
        reentered = self.routing if _active_routing() is None else contextlib.nullcontext()
        with seeds.key_scope(self.key), reentered:
            yield

    def __call__(self, *args, **kwargs):
        with self.scope():
            return self.function(*args, **kwargs)


def _routed(function):
    """``function`` as a :class:`_RoutedRegion` of the active :func:`route_dropout`, if any (and
    it is not one already)."""
    routing = _active_routing()
    return function if routing is None or isinstance(function, _RoutedRegion) else _RoutedRegion(function, routing)


def _routing_reentrant(forward):
    """A reentrant checkpoint Function's ``forward(ctx, run_function, preserve_rng_state, *args)``
    whose ``run_function`` (run in the forward and again, from ``ctx``, in the backward) is
    :func:`_routed`."""
    @functools.wraps(forward)
    def routing_forward(ctx, run_function, preserve_rng_state, *args):
        return forward(ctx, _routed(run_function), preserve_rng_state, *args)

    routing_forward.__torch_pallas_routes__ = True
    return routing_forward


def _routing_non_reentrant(generator):
    """torch's generator of a non-reentrant checkpoint, ``generator(fn, ...)``, whose first step
    precedes the region's forward (which the caller runs itself: its exception, if any, thrown
    into the generator) and whose second follows it, and whose ``fn`` is only recomputed: the
    forward runs in the region's scope between the two steps, the recomputations through
    :func:`_routed`."""
    @functools.wraps(generator)
    def routing_generator(fn, *options, **kwargs):
        region = _routed(fn)
        if region is fn:
            return (yield from generator(fn, *options, **kwargs))
        steps = generator(region, *options, **kwargs)
        next(steps)
        with region.scope():
            try:
                yield
            except BaseException as error:
                steps.throw(error)
                raise
        return (yield from steps)

    routing_generator.__torch_pallas_routes__ = True
    return routing_generator


# Where torch keeps its checkpoints' recomputing parts (private): torch.utils.checkpoint's
# reentrant Function (torch 2.9 to 2.15) and the generator of its non-reentrant mode (torch 2.9 to
# 2.13: _checkpoint_without_reentrant_generator(fn, ...); 2.14 calls an _impl(fn, ...) and keeps the
# first name as a shim around it), and the composable checkpoint of FSDP2's recipes, which imports
# the generator by name.
_NON_REENTRANT = ("_checkpoint_without_reentrant_generator_impl", "_checkpoint_without_reentrant_generator")
_COMPOSABLE_CHECKPOINT = "torch.distributed._composable.checkpoint_activation"


def _route_torch_checkpoints() -> None:
    """Makes torch's checkpoints (``torch.utils.checkpoint.checkpoint`` in both modes, which
    transformers' ``gradient_checkpointing_enable()`` and PEFT use; FSDP2's composable
    ``checkpoint``; the stack's own, torch_xla's) run a region entered inside
    :func:`route_dropout` as :class:`_RoutedRegion`: the recomputation routed as its forward was,
    drawing the forward's masks. Outside one, they run as torch wrote them. Called at import: a
    module that imports the generator later gets this one."""
    functions = (torch.utils.checkpoint.CheckpointFunction, *bridge.default_front_end().CHECKPOINT_FUNCTIONS)
    for function in functions:
        if not getattr(function.forward, "__torch_pallas_routes__", False):
            function.forward = staticmethod(_routing_reentrant(function.forward))
    if not any(hasattr(torch.utils.checkpoint, name) for name in _NON_REENTRANT):
        _checks.warn(f"torch_pallas.route_dropout: torch {torch.__version__}'s torch.utils.checkpoint has none of "
                     f"{', '.join(_NON_REENTRANT)}: its non-reentrant checkpoint recomputes outside the routing, "
                     "with torch's masks; use torch_pallas.checkpoint", stacklevel=2)
    for module in (torch.utils.checkpoint, sys.modules.get(_COMPOSABLE_CHECKPOINT)):
        for name in _NON_REENTRANT:
            generator = getattr(module, name, None)
            if generator is not None and not getattr(generator, "__torch_pallas_routes__", False):
                setattr(module, name, _routing_non_reentrant(generator))


_route_torch_checkpoints()
