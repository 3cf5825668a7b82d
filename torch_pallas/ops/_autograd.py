"""One factory per op's call: the custom op, its autograd formula stated once, and the one
layer a call crosses.

A custom op is what ``torch.compile`` traces (and torch's dispatcher needs for fake and
functional tensors), but in eager mode its Python dispatch (the autograd kernel, a
redispatch, the backend kernel, filling default arguments) costs more than the kernel call
itself, and torch 2.9's ``torch.func`` rejects the autograd Function ``register_autograd``
generates (no ``setup_context``) and forward-mode AD. So :func:`differentiable` builds, from
one ``setup_context`` / ``backward`` (/ ``jvp``), three forms, and its ``apply`` picks one:

- under ``torch.func`` or inside a forward-mode AD level (where dual tensors can exist): a
  Function with ``setup_context``, ``jvp`` and a vmap rule (dynamo breaks the graph at it;
  it runs eagerly);
- while compiling, under a ``TorchDispatchMode``, or on tensors torch traces (fake,
  functional, other subclasses): the custom op, with the formula registered as its autograd;
- on plain tensors in eager mode: the op's computation called directly, inside one plain
  Function when a gradient is needed (one Python autograd layer), or alone when not.
"""

from __future__ import annotations

import torch
from torch.autograd import forward_ad
from torch.autograd.function import once_differentiable

from torch_pallas import bridge

# Types whose calls run the computation directly: what eager XLA and CPU tensors are.
_PLAIN = (torch.Tensor, torch.nn.Parameter)


@torch.compiler.assume_constant_result  # dynamo evaluates it while tracing
def _under_torch_func() -> bool:
    return torch._C._functorch.peek_interpreter_stack() is not None


def _through_op(args) -> bool:
    """Whether a call with ``args`` must go through the custom op: while dynamo traces, under
    a ``TorchDispatchMode`` (which should see the op: fake tensors, flop counters), with a
    tensor torch traces or wraps, or with a meta tensor (shapes only: the op's fake function).
    AOTAutograd traces an op's registered backward with functional tensors
    (``torch.compiler.is_compiling()`` is False there), and ``torch.func`` runs a Function's
    backward, with the forward's wrapped tensors saved, outside its transforms' interpreter
    stack."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return True
    is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    return any(isinstance(arg, torch.Tensor) and (type(arg) not in _PLAIN or is_wrapped(arg) or arg.is_meta)
               for arg in args)


def direct(op, compute):
    """The call of an op without autograd (a backward op, a sampler): ``compute(*args)`` on
    plain tensors in eager mode, else ``op(*args)``."""
    bridge.register_op(op, compute)

    def apply(*args):
        if _under_torch_func() or _through_op(args):
            return op(*args)
        return compute(*args)

    apply.__doc__ = op.__doc__
    return apply


def differentiable(op, compute, *, public_name: str, setup_context, backward, jvp=None):
    """Registers ``backward`` (with ``setup_context``) as ``op``'s autograd and returns its
    ``apply(*args)`` (see the module's docstring).

    ``compute`` is the op's Python computation (what ``op`` runs). With ``jvp`` the op is
    linear in what it differentiates (dropout), so ``backward`` may call ``apply`` again and
    is differentiable itself; without, forward-mode AD raises naming ``public_name`` and the
    backward is once differentiable (no kernel computes a second derivative). vmap: the
    op's own batching rule if it registered one, else torch's per-sample loop.
    """
    op.register_autograd(backward, setup_context=setup_context)
    bridge.register_op(op, compute, (setup_context, backward))
    function_backward = staticmethod(backward if jvp is not None else once_differentiable(backward))
    name = public_name.rsplit(".", 1)[-1]

    def _jvp(ctx, *tangents):
        raise NotImplementedError(
            f"{public_name} has no forward-mode AD (torch.func.jvp, jacfwd, torch.autograd.forward_ad); "
            "use reverse mode: torch.func.grad, vjp or jacrev")

    # Its forward is the op, whose batching rule vmap needs; setup_context is torch.func's form.
    TorchFunc = type(f"{name}_function", (torch.autograd.Function,), dict(
        forward=staticmethod(op), setup_context=staticmethod(setup_context), backward=function_backward,
        jvp=staticmethod(jvp or _jvp), generate_vmap_rule=True))

    def eager_forward(ctx, *args):
        output = compute(*args)
        setup_context(ctx, args, output)
        return output

    # The old form (ctx in forward): Function.apply binds default arguments through
    # inspect.signature for a Function with setup_context, on every call. Applied through
    # torch's C entry point: Function.apply's Python adds only functorch's handling, and
    # calls under torch.func or with its wrapped tensors do not come here.
    Eager = type(f"{name}_eager", (torch.autograd.Function,), dict(
        forward=staticmethod(eager_forward), backward=function_backward))
    apply_eager = super(torch.autograd.Function, Eager).apply

    def apply(*args):
        if _under_torch_func() or (not torch.compiler.is_compiling() and forward_ad._current_level >= 0):
            return TorchFunc.apply(*args)
        if _through_op(args):
            return op(*args)
        if torch.is_grad_enabled() and any(isinstance(arg, torch.Tensor) and arg.requires_grad for arg in args):
            return apply_eager(*args)
        return compute(*args)

    return apply
