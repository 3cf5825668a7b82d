"""Routes torch's functional dropout to torch_pallas inside a scope, so dropouts that are
not ``nn.Dropout`` modules (``F.dropout`` calls in a model's forward) are reached too."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from torch_pallas import _checks, bridge
from torch_pallas import functional, residual_fusion
from torch_pallas.attention import check_dtensor_operands, scaled_dot_product_attention
from torch_pallas.kernels import arguments

__all__ = ["route_dropout"]


# The calls' arguments by name, as torch binds them: plain functions, which dynamo traces (it
# cannot trace inspect.signature's binding, nor read its mapping proxy once traced code has
# mutated a dict), raising TypeError for calls torch would reject.
def _dropout_arguments(input, p=0.5, training=True, inplace=False):
    return input, p, training, inplace


def _torch_dropout_arguments(input, p, train):
    return input, p, train, False


def _sdpa_arguments(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False):
    return dict(query=query, key=key, value=value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                scale=scale, enable_gqa=enable_gqa)


# torch's function -> (its arguments' parser; ours, with the same leading parameters)
_DROPOUTS = {
    F.dropout: (_dropout_arguments, functional.dropout),
    torch.dropout: (_torch_dropout_arguments, functional.dropout),
    F.dropout1d: (_dropout_arguments, functional.dropout1d),
    F.dropout2d: (_dropout_arguments, functional.dropout2d),
    F.dropout3d: (_dropout_arguments, functional.dropout3d),
}
_SDPA_WARNING = ("torch_pallas.route_dropout: this scaled_dot_product_attention call's dropout_p is applied by torch "
                 "with torch's RNG: {reason}")
# route_dropout's default fuses F.linear after a dropout for weights of at most this many output features: the
# fused kernel's case (a skinny product under the MXU's width; LoRA's ranks). LoRA's steps are faster fused at
# rank 16, T5's wo(dropout(h)) of 768 features slower (bench/results/tpu_step.md, docs/lora.md).
SKINNY_LINEAR_FEATURES = 128
# Which F.scaled_dot_product_attention calls route_dropout runs as torch_pallas's.
ATTENTION_ROUTES = ("dropout", "all", "none")


class route_dropout(TorchFunctionMode):
    r"""Within it, ``torch.nn.functional.dropout``, ``torch.dropout`` (and so every
    ``torch.nn.Dropout`` module) on float tensors on a device torch_pallas runs on
    (:ref:`devices`) run as :func:`torch_pallas.dropout`, ``F.dropout1d/2d/3d`` as their
    torch_pallas counterparts, and ``F.scaled_dot_product_attention(..., dropout_p > 0)`` (a
    transformers model's default ``sdpa`` attention) on accelerator tensors as
    :func:`torch_pallas.scaled_dot_product_attention`; what torch_pallas does not take goes to
    torch unchanged (SDPA calls with dropout warn once per call site), and so do
    ``F.alpha_dropout`` and ``F.feature_alpha_dropout``, which keep a SELU network's statistics.

    A :class:`torch.overrides.TorchFunctionMode`: eager, under ``torch.compile`` (entered around
    the compiled call or inside it; ``fullgraph=True`` works) and ``torch.fx`` tracing, which
    records the calls as written. Keys come from the RNG of the input's device (:ref:`where
    keys come from <key-sources>`). ``torch.utils.checkpoint`` (both modes; transformers'
    ``gradient_checkpointing_enable()``), FSDP2's ``checkpoint`` and torch_xla's checkpoint of a
    region entered inside it recompute that region routed, each dropout with its forward's mask,
    whether ``backward()`` runs inside the scope or after it (autograd runs the backward pass
    outside every function mode: :mod:`torch_pallas.checkpointing`).

    On tensors that run lazily (torch_xla's; torchax's inside a JAX trace) what reads a dropout's
    output runs in one kernel with it, which then keeps no dropped copy for the backward pass
    (:ref:`what each saves <fusion>`):

    - a residual add, ``residual + dropout(x)`` (``+=``, ``torch.add``), as
      :func:`torch_pallas.dropout_add`: the same mask; the sum is computed in float32 and
      rounded once, the exact sum rounded to the tensor's dtype (to within float32's rounding),
      where torch rounds the dropped value and then the sum: equal for float32, and for 16-bit
      tensors at least as close to the exact sum;
    - eager attention's ``dropout(softmax(scores)) @ value``, as
      :func:`torch_pallas.dropout_matmul`, with the softmax too (rows of at most 16384 scores),
      and as :func:`torch_pallas.scaled_dot_product_attention` where the scores are
      ``query @ key.transpose(-2, -1)``, scaled, masked by a selection or an added mask (BERT's,
      GPT-2's, ViT's eager attention); within float32 rounding of unfused;
    - a linear layer of at most 128 output features, ``F.linear(dropout(x), weight)`` (PEFT's
      ``lora_A``, classifier heads), as :func:`torch_pallas.dropout_linear`; wider ones are not
      faster fused.

    Fused or not, each dropout draws one mask: a fused kernel draws the mask the dropout's output
    holds. The output of a softmax over the last dim computed inside this scope (and its dtype
    conversions) is attention weights, whose dropout draws the mask the attention kernels draw
    (per tile of each ``L x S`` plane with the default ``impl="tiled"``;
    :func:`torch_pallas.dropout_matmul`): the one mask here that is not
    :func:`torch_pallas.dropout`'s for the same key with the per-tile impls (``"tiled"``,
    ``"hardware"``; with ``"threefry"`` the two are one). Reading the dropped weights elsewhere
    (``output_attentions=True``) gives that mask too.

    Args:
        impl (str, optional): the noise generator, as :class:`torch_pallas.nn.Dropout` takes it.
        attention (str): which ``F.scaled_dot_product_attention`` calls run as torch_pallas's:
            ``"dropout"`` (default) those with ``dropout_p > 0``, ``"all"`` every one, ``"none"``
            none.
        fuse_residual (bool), fuse_matmul (bool): ``False`` leaves residual adds, eager
            attention's products unfused. Default: ``True``.
        fuse_linear (bool, optional): ``False`` fuses no linear layer, ``True`` every one.
            Default: ``None``, those of at most 128 output features.

    Raises:
        ValueError: an unknown ``impl`` or ``attention``, or ``impl="hardware"`` off TPU.
        TypeError: ``fuse_residual`` or ``fuse_matmul`` is not a bool, or ``fuse_linear`` is
            neither a bool nor ``None``.

    Example::

        >>> with torch_pallas.route_dropout():
        ...     loss = model(inputs).loss   # every F.dropout in the model is torch_pallas's
        >>> loss.backward()                  # masks regenerated from their keys
    """

    def __init__(self, *, impl=None, attention: str = "dropout", fuse_residual: bool = True,
                 fuse_matmul: bool = True, fuse_linear: bool | None = None):
        super().__init__()
        _checks.resolve_impl(impl)
        self.impl = impl
        self.attention = arguments.check_one_of("attention", attention, ATTENTION_ROUTES)
        for name, value in (("fuse_residual", fuse_residual), ("fuse_matmul", fuse_matmul)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
        if fuse_linear is not None and not isinstance(fuse_linear, bool):
            raise TypeError(f"fuse_linear must be True, False or None, got {type(fuse_linear).__name__} "
                            f"{fuse_linear!r}")
        self.fuse_residual = fuse_residual
        self.fuse_matmul = fuse_matmul
        self.fuse_linear = fuse_linear

    def _fuses(self, input: torch.Tensor) -> bool:
        """Whether a dropout of ``input`` routed here remembers its key for what reads it to fuse
        with it: with any fusion on."""
        return self.fuse_residual or self.fuse_matmul or self.fuse_linear is not False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _TAKEN or _traced_by_fx(args, kwargs):
            # torch.fx records a call as it is written (the recorded graph runs the functions a
            # model calls when it runs, inside this mode or not).
            return func(*args, **kwargs)
        if func in _DROPOUTS:
            parse, ours = _DROPOUTS[func]
            input, p, training, inplace = parse(*args, **kwargs)
            if not (isinstance(input, torch.Tensor) and input.is_floating_point() and bridge.runs_on(input.device)):
                return func(*args, **kwargs)
            if ours is not functional.dropout:
                return ours(input, p, training, inplace, impl=self.impl)
            output = residual_fusion.routed_dropout(input, p, training, self.impl,
                                                    fusing=not inplace and self._fuses(input))
            return input.copy_(output) if inplace and output is not input else output
        if func in residual_fusion.SOFTMAXES:
            return residual_fusion.remembered_softmax(func, args, kwargs,
                                                      self.fuse_matmul and not torch.compiler.is_compiling())
        if func in residual_fusion.CONVERSIONS:
            return residual_fusion.converted(func, args, kwargs,
                                             self.fuse_linear is not False and not torch.compiler.is_compiling())
        if func is F.scaled_dot_product_attention:
            return self._attention(func, args, kwargs)
        if torch.compiler.is_compiling():
            # What follows remembers tensors' versions, which dynamo cannot trace; the
            # "torch_pallas" backend fuses residual adds in the compiled graph instead.
            return func(*args, **kwargs)
        if func in residual_fusion.ADDS and (self.fuse_residual or self.fuse_matmul):
            fused = residual_fusion.fused_add(func, args, kwargs) if self.fuse_residual else None
            if fused is not None:
                return fused
            if self.fuse_matmul:
                return residual_fusion.remembered_scores(func, args, kwargs)
        elif func is F.linear and self.fuse_linear is not False:
            fused = residual_fusion.fused_linear(args, kwargs, None if self.fuse_linear else SKINNY_LINEAR_FEATURES)
            if fused is not None:
                return fused
        elif func in residual_fusion.MATMULS and self.fuse_matmul:
            fused = residual_fusion.fused_matmul(func, args, kwargs)
            return fused if fused is not None else residual_fusion.remembered_scores(func, args, kwargs)
        elif (func in residual_fusion.SCALINGS or func in residual_fusion.SELECTIONS) and self.fuse_matmul:
            return residual_fusion.remembered_scores(func, args, kwargs)
        elif func is torch.full and self.fuse_matmul:
            return residual_fusion.remembered_number(func, args, kwargs)
        return func(*args, **kwargs)

    def _attention(self, func, args, kwargs):
        """An SDPA call: torch_pallas's attention where it takes it (see the class docstring)."""
        if self.attention != "none":
            arguments = _sdpa_arguments(*args, **kwargs)
            dropout_p = arguments["dropout_p"]
            if dropout_p or self.attention == "all":
                refusal = _attention_refusal(**arguments)
                if refusal is None:
                    return scaled_dot_product_attention(**arguments, impl=self.impl)
                if dropout_p:
                    # No state kept here, so that dynamo has nothing to guard on and recompile for.
                    _checks.warn(_SDPA_WARNING.format(reason=refusal), stacklevel=3)
        return func(*args, **kwargs)


# Every torch function route_dropout does anything with; it hands any other call on untouched.
_TAKEN = frozenset((*_DROPOUTS, *residual_fusion.SOFTMAXES, *residual_fusion.CONVERSIONS,
                    F.scaled_dot_product_attention, *residual_fusion.ADDS, F.linear, *residual_fusion.MATMULS,
                    *residual_fusion.SCALINGS, *residual_fusion.SELECTIONS, torch.full))


def _traced_by_fx(args, kwargs) -> bool:
    """Whether a call's arguments hold a ``torch.fx.Proxy`` (symbolic tracing: ``torch.fx.symbolic_trace``,
    transformers' ``HFTracer``)."""
    return any(isinstance(arg, torch.fx.Proxy) for arg in (*args, *kwargs.values()))


def fusing_route(input: torch.Tensor) -> route_dropout | None:
    """The innermost active :class:`route_dropout` if it fuses a dropout of ``input``
    (``route_dropout._fuses``), for dropouts that are not torch functions
    (:class:`torch_pallas.nn.Dropout`) to be fused as routed ones are; ``None`` outside one and
    while dynamo traces. Reads torch's private
    ``torch.overrides._get_current_function_mode_stack`` (torch 2.9 to 2.14)."""
    if torch.compiler.is_compiling():
        return None
    for mode in reversed(torch.overrides._get_current_function_mode_stack()):
        if isinstance(mode, route_dropout):
            return mode if mode._fuses(input) else None
    return None


# A front end that takes SDPA at torch-function level (torchax's function mode, entered again
# inside every step its helpers build) lets the innermost route_dropout see it first.
bridge.defer_function_to_mode(F.scaled_dot_product_attention, route_dropout)


def _attention_refusal(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> str | None:
    """Why an SDPA call stays torch's (``None``: it is routed). Calls torch would reject go
    to torch, which raises its own error."""
    tensors = (query, key, value)
    if not all(isinstance(t, torch.Tensor) for t in tensors) or query.device.type == "cpu" or not bridge.runs_on(
            query.device):
        return "its tensors are not on an accelerator device (XLA, torchax, TorchTPU)"
    if any(bridge.is_dtensor(t) for t in (*tensors, attn_mask)):
        try:
            check_dtensor_operands(query, key, value, attn_mask)
        except (TypeError, ValueError) as error:
            return str(error)
    if query.dtype not in _checks.FLOAT_DTYPES:
        return f"torch_pallas's attention takes float32, bfloat16 and float16, not {query.dtype}"
    if any(t.dtype != query.dtype or t.device != query.device for t in tensors[1:]):
        return "query, key and value differ in dtype or device"
    if attn_mask is not None and (attn_mask.dtype not in (torch.bool, query.dtype) or is_causal):
        return "its attn_mask is of another dtype, or comes with is_causal"
    return None
