"""Calls an op through its ``torch.autograd.Function``, or directly where dynamo traces.

A custom op's ``register_autograd`` is enough for autograd and ``torch.compile``, but not
for ``torch.func`` (torch 2.9 rejects the Function it generates: no ``setup_context``) nor
forward-mode AD. Each op module therefore also defines a Function with ``setup_context``
and ``jvp``; dynamo cannot trace a Function with a custom ``jvp``, so compiled code
outside ``torch.func`` calls the op, and under ``torch.func`` dynamo breaks the graph at
the Function, which then runs eagerly.
"""

from __future__ import annotations

import torch


@torch.compiler.assume_constant_result  # dynamo evaluates it while tracing
def _under_torch_func() -> bool:
    return torch._C._functorch.peek_interpreter_stack() is not None


def call(function: type[torch.autograd.Function], op, *args):
    """``function.apply(*args)``, or ``op(*args)`` while dynamo traces outside ``torch.func``."""
    if torch.compiler.is_compiling() and not _under_torch_func():
        return op(*args)
    return function.apply(*args)
