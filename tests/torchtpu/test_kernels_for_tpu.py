"""The kernels as TorchTPU gets them (each op's jax_op export for TPU, lowered for one TPU
generation) compiled by libtpu for v5e, v6e and TPU7x (attention and IndRNN: v6e and TPU7x):
what the ops hand the front end is recorded on fake tpu tensors, exported as TorchTPU's custom
op exports it, and compiled."""

import jax
import pytest
import torch

import torch_pallas
from conftest import NEEDS_LIBTPU
from torchtpu_support import DispatchedOps
from torch_pallas import bridge, tpu_compile
from torch_pallas.frontends import torchtpu

pytestmark = [NEEDS_LIBTPU, pytest.mark.tpu_compile]

CALLS = {
    "dropout float16 (widened to float32 at the kernel)": lambda x, r: torch_pallas.dropout(x.half(), 0.1, seed=1),
    "dropout bfloat16": lambda x, r: torch_pallas.dropout(x.bfloat16(), 0.1, seed=1),
    "dropout float32": lambda x, r: torch_pallas.dropout(x, 0.1, seed=1),
    "dropout_add float32": lambda x, r: torch_pallas.dropout_add(x, r, 0.1, seed=1),
    # LoRA's down-projection (rank 16) of 256 rows of 1024 features.
    "dropout_linear bfloat16": lambda x, r: torch_pallas.dropout_linear(x.bfloat16(), r[:16].bfloat16(), p=0.1,
                                                                         seed=1),
    # The hardware PRNG is accepted where kernels lower for TPU (a TPU; here, asked for).
    "dropout hardware bfloat16": lambda x, r: _lowering_for_tpu(torch_pallas.dropout, x.bfloat16(), 0.1, seed=1,
                                                                 impl="hardware"),
    # Multi-output kernels: (output, log-sum-exp), (output, h_n).
    "attention forward bfloat16 causal": lambda x, r: torch_pallas.scaled_dot_product_attention(
        *[x.bfloat16().view(1, 8, 256, 128)] * 3, dropout_p=0.1, is_causal=True, seed=1),
    "indrnn forward float32": lambda x, r: torch_pallas.indrnn(x.view(16, 16, 1024), r[0]),
    # Routed attention weights dropped alone (no product fuses on tpu tensors): the attention kernels' mask.
    "dropout_weights bfloat16": lambda x, r: _routed(lambda: torch.nn.functional.dropout(
        torch.softmax(x.bfloat16().view(4, 2, 256, 128), dim=-1), 0.1)),
}
GENERATIONS = {name: ("v6e", "tpu7x") if name.startswith(("attention", "indrnn")) else ("v5e", "v6e", "tpu7x")
               for name in CALLS}


def _routed(call):
    with torch_pallas.route_dropout():
        return call()


def _lowering_for_tpu(function, *args, **keywords):
    with bridge.lowering_for_tpu():
        return function(*args, **keywords)


def _handed_to_the_front_end(call, monkeypatch):
    """(jax_function, tensors, static) of each kernel ``call`` hands the front end on fake tpu
    tensors: torch runs a custom op's fake function under fake mode, so each op dispatched is
    recorded and its computation (what a real tpu tensor runs) called after."""
    from torch._subclasses import FakeTensorMode
    from torch_pallas.ops import (attention as attention_ops, dropout as dropout_ops,
                                  dropout_linear as dropout_linear_ops, dropout_matmul as dropout_matmul_ops,
                                  indrnn as indrnn_ops)

    computations = {"torch_pallas::dropout": dropout_ops._compute_dropout,
                    "torch_pallas::dropout_weights": dropout_matmul_ops._compute_dropout_weights,
                    "torch_pallas::dropout_add": dropout_ops._compute_dropout_add,
                    "torch_pallas::dropout_linear": dropout_linear_ops._compute_dropout_linear,
                    "torch_pallas::attention": attention_ops._compute_attention,
                    "torch_pallas::indrnn": indrnn_ops._compute_indrnn}
    dispatched = DispatchedOps(record_args=True)
    handed = []
    front_end_call = torchtpu.call
    monkeypatch.setattr(torchtpu, "call", lambda function, tensors, static: handed.append(
        (function, tensors, static)) or front_end_call(function, tensors, static))
    with FakeTensorMode():
        x, residual = torch.randn(256, 1024, device="tpu"), torch.randn(256, 1024, device="tpu")
        with dispatched:
            call(x, residual)
        for name, args in dispatched.calls:
            if name in computations:
                computations[name](*args)
    return handed


def _exported(jax_function, tensors, static):
    """The ``jax.export`` TorchTPU's custom op of the kernel makes (what its fake function and,
    on a TPU, its call compute), lowered for the front end's generation."""
    from torch._subclasses import FakeTensorMode

    with FakeTensorMode():
        op = torchtpu._kernel_op(jax_function, tensors, static)
    kernel = op._init_fn  # TorchTPU's JaxCallable
    arguments, keywords = kernel._get_jax_placeholders(*kernel._normalize_invocation_args(list(tensors), {}))
    with torchtpu._lowering_context(), jax._src.config.export_ignore_forward_compatibility(True):
        return kernel.exported(*arguments, **keywords)


@pytest.mark.parametrize("name, generation", [(name, generation) for name in CALLS for generation in GENERATIONS[name]])
def test_the_exported_kernel_compiles_for_the_generation_it_was_lowered_for(name, generation, monkeypatch):
    monkeypatch.setenv(torchtpu.GENERATION_VARIABLE, generation)
    torchtpu._generation.cache_clear()
    try:
        handed = _handed_to_the_front_end(CALLS[name], monkeypatch)
        assert len(handed) == 1, handed
        exported = _exported(*handed[0])
        assert exported.platforms == ("tpu",)
        assert "tpu_custom_call" in exported.mlir_module()  # Mosaic, not interpret mode
        arguments = [jax.ShapeDtypeStruct(aval.shape, aval.dtype) for aval in exported.in_avals]
        compiled = tpu_compile.compile_for_tpu(exported.call, *arguments, generation=generation)
        assert "tpu_custom_call" in compiled.as_text()  # the Mosaic kernel, compiled by libtpu
    finally:
        monkeypatch.undo()
        torchtpu._generation.cache_clear()
