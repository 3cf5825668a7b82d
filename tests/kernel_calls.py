"""Records the kernel calls a test's code makes, through the bridge every kernel passes, and the
calls of torch's own attention."""

import re

import torch
from torch.overrides import TorchFunctionMode

from torch_pallas import bridge
from torch_pallas.kernels import attention as attention_kernels, dropout as dropout_kernels
from torch_pallas.kernels import dropout_matmul as dropout_matmul_kernels

# The kernels that draw a dropout mask from their first operand, the key data: one call per dropout
# (a routed dropout's own kernel is called even where a fused kernel reads its input instead, its
# node then dead: the fused kernels are left out), attention's, and attention weights' dropped alone.
DROPOUT_KERNELS = (dropout_kernels.dropout, attention_kernels.attention_forward, attention_kernels.attention_backward,
                   dropout_matmul_kernels.dropout_weights)


def record_dropout_keys(monkeypatch) -> list:
    """Key data of every dropout kernel call from now on (dropout's and attention's: forward,
    recomputation and backward; autograd runs the backward on another thread, so no
    dispatch mode sees it)."""
    keys, call = [], bridge.call

    def recording_call(jax_function, *tensors, **static):
        if jax_function in DROPOUT_KERNELS and static.get("dropout_p", static.get("p")):
            keys.append(tuple(tensors[0].cpu().tolist()))
        return call(jax_function, *tensors, **static)

    monkeypatch.setattr(bridge, "call", recording_call)
    return keys



def kernel_calls(*tensors) -> tuple[dict, list]:
    """The lazy graph of XLA ``tensors``, dead nodes left out: the shape of each node (``{"%3":
    "f32[16,128]{1,0}"}``) and each torch_pallas kernel's output shape (a parenthesised tuple of
    shapes for several outputs: attention's) and operands."""
    import torch_xla

    text = torch_xla._XLAC._get_xla_tensors_text(list(tensors))
    calls = [(output, [operand.strip() for operand in operands.split(",")])
             for output, operands in re.findall(r"= (\(.*?\)|\S+) xla::torch_pallas\(([^)]*)\)", text)]
    return dict(re.findall(r"(%\d+) = (\S+)", text)), calls


def record_kernels(monkeypatch) -> list:
    """``(kernel, interpret)`` of every kernel the JAX-array front ends (torchax) apply from now
    on: ``interpret`` False where it is lowered for TPU."""
    kernels, jitted = [], bridge.jitted
    monkeypatch.setattr(bridge, "jitted", lambda f, static, interpret: kernels.append((f, interpret))
                        or jitted(f, static, interpret))
    return kernels


class TorchSDPACalls(TorchFunctionMode):
    """Counts calls of torch's scaled_dot_product_attention (on torchax, entered inside its
    environment, it sees them before torchax's own mode)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += func is torch.nn.functional.scaled_dot_product_attention
        return func(*args, **(kwargs or {}))
