"""Routes torch's functional dropout to torch_pallas inside a scope, so dropouts that are
not ``nn.Dropout`` modules (``F.dropout`` calls in a model's forward) are reached too."""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from torch_pallas import _checks, bridge
from torch_pallas import functional, residual_fusion
from torch_pallas.attention import check_dtensor_operands, scaled_dot_product_attention
from torch_pallas.kernels import arguments

__all__ = ["route_dropout"]

# torch's function -> (its signature, to bind calls; ours, with the same leading parameters)
_DROPOUTS = {
    F.dropout: (inspect.signature(F.dropout), functional.dropout),
    torch.dropout: (inspect.signature(lambda input, p, train: None), functional.dropout),
    F.dropout1d: (inspect.signature(F.dropout1d), functional.dropout1d),
    F.dropout2d: (inspect.signature(F.dropout2d), functional.dropout2d),
    F.dropout3d: (inspect.signature(F.dropout3d), functional.dropout3d),
}
_SDPA_SIGNATURE = inspect.signature(
    lambda query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False: None)
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
    (:ref:`devices`) run as :func:`torch_pallas.dropout`, and ``F.dropout1d/2d/3d`` (``nn.Dropout1d/2d/3d``) as
    their torch_pallas counterparts.

    A :class:`torch.overrides.TorchFunctionMode`: it works in eager mode and under
    ``torch.compile(backend="openxla")`` (dynamo traces the mode), entered around the
    compiled call or inside the compiled function. Calls on other devices, or on tensors
    that are not floating point, go to torch unchanged, and so do ``F.alpha_dropout`` and
    ``F.feature_alpha_dropout`` (``nn.AlphaDropout``, ``nn.FeatureAlphaDropout``): they keep a
    SELU network's mean and variance, which ordinary dropout would not. Keys come from the RNG of the
    input's device (or the enclosing :func:`torch_pallas.seeds.key_scope`, as inside
    :func:`torch_pallas.checkpoint`).
    ``F.scaled_dot_product_attention(..., dropout_p > 0)`` on XLA, torchax or TorchTPU tensors of a
    dtype it takes runs as :func:`torch_pallas.scaled_dot_product_attention` (flash kernels,
    the mask from a key; transformers models' default ``sdpa`` attention); other calls with
    ``dropout_p > 0`` stay torch's and warn once per call site. On torchax, whose own
    function mode takes SDPA whole, this holds whether torchax's environment is entered
    inside this mode or outside it (:func:`torch_pallas.bridge.defer_function_to_mode`).

    Args:
        impl (str, optional): the routed calls' noise generator, as
            :class:`torch_pallas.nn.Dropout` takes it.
        attention (str): which ``F.scaled_dot_product_attention`` calls on XLA tensors run
            as torch_pallas's: ``"dropout"`` (default) those with ``dropout_p > 0``,
            ``"all"`` every one (evaluation too), ``"none"`` none.
        fuse_matmul (bool): run ``torch.matmul`` (``@``, ``Tensor.matmul``) of a routed
            ``F.dropout`` / ``torch.dropout`` output ``(*batch, L, S)`` (eager attention's
            dropped weights) and a value ``(*batch, S, Ev)`` of its batch dims, dtype and
            device as :func:`torch_pallas.dropout_matmul` with the dropout's key: one kernel
            that keeps no dropped weights for the backward pass. When the dropout's input is
            ``F.softmax`` / ``torch.softmax`` / ``Tensor.softmax`` of scores over their last
            dim (in their dtype), rows of at most 16384, the softmax joins the kernel too
            (computed in float32 and rounded once, whole rows per block: within float32
            rounding of unfused), and only the scores are kept. When the scores are
            ``query @ key.transpose(-2, -1)`` of one batch shape, then at most one ``*`` or
            ``/`` by a number (a Python number or a 0-dim ``torch.full``), then at most one
            ``torch.where(keep, scores, fill)`` or ``scores.masked_fill(dropped, fill)`` with a
            boolean mask and the dtype's lowest number (not ``-inf``), then at most one
            added mask of their dtype that broadcasts to them (BERT's, ViT's and GPT-2's eager
            attention), the whole attention runs
            as :func:`torch_pallas.scaled_dot_product_attention` with the dropout's key (the
            same mask), and nothing of size ``L x S`` is kept. Converted
            :class:`torch_pallas.nn.Dropout` modules are fused as routed ``F.dropout`` calls
            are. With ``impl="threefry"`` the same mask; with ``impl="tiled"`` (the default) or
            ``"hardware"`` the mask is drawn per attention tile
            (:func:`torch_pallas.dropout_matmul`), not the one the dropout's own output
            holds, so read that output nowhere else (``output_attentions``) with this on.
            Lazily run tensors only, as ``fuse_residual``; not under ``torch.func``'s
            transforms. Default: ``False``, for that mask.
        fuse_linear (bool, optional): run ``F.linear`` (``nn.Linear``) of a routed
            ``F.dropout`` / ``torch.dropout`` output, or a converted
            :class:`torch_pallas.nn.Dropout`'s, as :func:`torch_pallas.dropout_linear` with the
            dropout's key: the dropout's mask bit for bit on every impl, the unfused calls'
            values and gradients (the product accumulated in float32), and autograd keeps the
            dropout's input, not the dropped copy. Where that input is a 16-bit tensor's
            ``.to(torch.float32)``, as PEFT's float32 adapters cast a bfloat16 model's
            activations, the kernel reads the 16-bit tensor. ``None`` (default): the layers
            where it pays, those with at most 128 output features (PEFT's LoRA
            ``lora_A(dropout(x))`` at its ranks, faster in every LoRA step measured; a
            classifier head); ``True``: every one (T5's ``wo(dropout(h))`` too, whose 768
            output features take longer fused: docs/lora.md); ``False``: none. A dropout
            output also read elsewhere runs its own kernel too, and each fused layer draws the
            mask again. Lazily run tensors only (torch_xla's lazy tensors, torchax's inside a
            JAX trace); not under ``torch.compile`` or ``torch.func``'s transforms.
        fuse_residual (bool): run an add of a routed ``F.dropout`` / ``torch.dropout``
            output and a tensor of its shape, dtype and device (``residual + dropout(x)``,
            ``dropout(x) + residual``, ``torch.add``, ``residual += dropout(x)``, ``add_``)
            as :func:`torch_pallas.dropout_add` with the dropout's key: the same mask, the
            sum rounded once in float32 (the same bits as unfused for float32 and float64
            tensors). On tensors that run lazily (torch_xla's, torchax's inside a JAX
            trace), where the dropout's own kernel then never runs; not on eager CPU
            tensors, and not under ``torch.compile``, where the ``"torch_pallas"`` backend
            fuses instead. Not if the dropout's input or output was written in place in
            between. Default: ``False``: a 16-bit sum rounded once may differ from torch's
            two roundings.

    Raises:
        ValueError: an unknown ``impl`` or ``attention``, or ``impl="hardware"`` off TPU.
        TypeError: ``fuse_residual`` or ``fuse_matmul`` is not a bool, or ``fuse_linear`` is
            neither a bool nor ``None``.

    Example::

        >>> with torch_pallas.route_dropout():
        ...     loss = model(inputs).loss   # every F.dropout in the model is torch_pallas's
        >>> loss.backward()                  # masks regenerated from their keys
    """

    def __init__(self, *, impl=None, attention: str = "dropout", fuse_residual: bool = False,
                 fuse_matmul: bool = False, fuse_linear: bool | None = None):
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
        """Whether a dropout of ``input`` routed here runs as one whose reader may fuse it: with
        ``fuse_residual`` or ``fuse_matmul``, or ``fuse_linear`` on a lazily run tensor (the
        default leaves every other dropout as it was)."""
        return (self.fuse_residual or self.fuse_matmul
                or (self.fuse_linear is not False and isinstance(input, torch.Tensor)
                    and not torch.compiler.is_compiling() and bridge.runs_lazily(input)))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _DROPOUTS:
            signature, ours = _DROPOUTS[func]
            call = signature.bind(*args, **kwargs)
            call.apply_defaults()
            input, p, training = call.args[:3]
            if input.is_floating_point() and bridge.runs_on(input.device):
                inplace = call.arguments.get("inplace", False)
                if ours is functional.dropout and not inplace and not bridge.is_dtensor(input) and self._fuses(input):
                    return residual_fusion.routed_dropout(input, p, training, self.impl)
                return ours(input, p, training, inplace, impl=self.impl)
        elif ((self.fuse_residual or self.fuse_matmul) and func in residual_fusion.ADDS
              and not torch.compiler.is_compiling()):
            fused = residual_fusion.fused_add(func, args, kwargs) if self.fuse_residual else None
            if fused is not None:
                return fused
            if self.fuse_matmul:
                return residual_fusion.remembered_scores(func, args, kwargs)
        elif self.fuse_linear is not False and func is torch.Tensor.to and not torch.compiler.is_compiling():
            return residual_fusion.remembered_widening(func, args, kwargs)
        elif self.fuse_linear is not False and func is F.linear and not torch.compiler.is_compiling():
            fused = residual_fusion.fused_linear(args, kwargs, None if self.fuse_linear else SKINNY_LINEAR_FEATURES)
            if fused is not None:
                return fused
        elif self.fuse_matmul and func in residual_fusion.MATMULS and not torch.compiler.is_compiling():
            fused = residual_fusion.fused_matmul(func, args, kwargs)
            return fused if fused is not None else residual_fusion.remembered_scores(func, args, kwargs)
        elif (self.fuse_matmul and (func in residual_fusion.SCALINGS or func in residual_fusion.SELECTIONS)
              and not torch.compiler.is_compiling()):
            return residual_fusion.remembered_scores(func, args, kwargs)
        elif self.fuse_matmul and func is torch.full and not torch.compiler.is_compiling():
            return residual_fusion.remembered_number(func, args, kwargs)
        elif self.fuse_matmul and func in residual_fusion.SOFTMAXES and not torch.compiler.is_compiling():
            return residual_fusion.remembered_softmax(func, args, kwargs)
        elif func is F.scaled_dot_product_attention and self.attention != "none":
            call = _SDPA_SIGNATURE.bind(*args, **kwargs)
            call.apply_defaults()
            dropout_p = call.arguments["dropout_p"]
            if dropout_p or self.attention == "all":
                refusal = _attention_refusal(**call.arguments)
                if refusal is None:
                    return scaled_dot_product_attention(**call.arguments, impl=self.impl)
                if dropout_p:
                    # No state kept here, so that dynamo has nothing to guard on and recompile for.
                    _checks.warn(_SDPA_WARNING.format(reason=refusal), stacklevel=2)
        return func(*args, **kwargs)


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
