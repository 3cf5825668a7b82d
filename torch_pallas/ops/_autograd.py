"""Calls an op directly, or through its ``torch.autograd.Function`` where that is needed.

A custom op's ``register_autograd`` is enough for autograd and ``torch.compile``, but not
for ``torch.func`` (torch 2.9 rejects the Function it generates: no ``setup_context``) nor
forward-mode AD. Each op module therefore also defines a Function with ``setup_context``
and ``jvp``, used only there: everywhere else (eager autograd, and compiled code, since
dynamo cannot trace a Function with a custom ``jvp``) a call crosses the op's own autograd
layer alone. Under ``torch.func`` dynamo breaks the graph at the Function, which then runs
eagerly.
"""

from __future__ import annotations

import torch
from torch.autograd import forward_ad
from torch.autograd.function import once_differentiable


@torch.compiler.assume_constant_result  # dynamo evaluates it while tracing
def _under_torch_func() -> bool:
    return torch._C._functorch.peek_interpreter_stack() is not None


def call(function: type[torch.autograd.Function], op, *args):
    """``function.apply(*args)`` under ``torch.func`` or inside a forward-mode AD level (where
    dual tensors can exist), else ``op(*args)``."""
    if _under_torch_func() or (not torch.compiler.is_compiling() and forward_ad._current_level >= 0):
        return function.apply(*args)
    return op(*args)


def reverse_mode_function(public_name: str, op, setup_context, backward) -> type[torch.autograd.Function]:
    """The ``torch.autograd.Function`` of an op with reverse-mode autograd only: ``op``'s own
    ``setup_context`` and ``backward`` (once differentiable: no kernel computes a second
    derivative), torch's per-sample loop for vmap, and a jvp that raises naming
    ``public_name``."""
    class ReverseMode(torch.autograd.Function):
        forward = staticmethod(op)
        generate_vmap_rule = True

        @staticmethod
        def setup_context(ctx, inputs, output):
            setup_context(ctx, inputs, output)

        @staticmethod
        @once_differentiable
        def backward(ctx, *grads):
            return backward(ctx, *grads)

        @staticmethod
        def jvp(ctx, *tangents):
            raise NotImplementedError(
                f"{public_name} has no forward-mode AD (torch.func.jvp, jacfwd, torch.autograd.forward_ad); "
                "use reverse mode: torch.func.grad, vjp or jacrev")

    ReverseMode.__name__ = ReverseMode.__qualname__ = f"{public_name.rsplit('.', 1)[-1]}_function"
    return ReverseMode
