"""scaled_dot_product_attention and indrnn (function and module) on fake ``tpu`` tensors: the
op dispatched, the multi-output kernels through TorchTPU's jax_op (a tuple or list of ``tpu``
tensors back), their backward formulas."""

import pytest
import torch

import torch_pallas
from torchtpu_support import check_dispatches, check_formula_dispatches, check_kernel_op, check_on_tpu
from torch_pallas.ops import attention as attention_op, indrnn as indrnn_op

QUERY, LSE = (2, 4, 128, 64), (2, 4, 128)
T, B, F = 16, 4, 128


def _qkv(dtype=torch.float32):
    return [torch.randn(QUERY, device="tpu", dtype=dtype) for _ in range(3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_dispatches_its_op_and_returns_a_tpu_tensor(fake, dtype):
    query, key, value = _qkv(dtype)
    mask = torch.ones(128, 128, device="tpu", dtype=torch.bool).tril()
    for keywords in (dict(dropout_p=0.1, is_causal=True), dict(attn_mask=mask, dropout_p=0.1, seed=1), {}):
        out = check_dispatches(lambda: torch_pallas.scaled_dot_product_attention(query, key, value, **keywords),
                               "torch_pallas::attention")
        check_on_tpu(out, QUERY, dtype)


@pytest.mark.parametrize("masked, dtype", [(False, torch.bfloat16), (True, torch.bfloat16), (False, torch.float32)])
def test_attention_kernels_return_their_outputs_through_torchtpu_jax_ops(fake, masked, dtype):
    """Forward: (output, float32 log-sum-exp, the operands the backward reads: float32 ones
    rounded to bfloat16 on a TPU, else none); backward: [grad q, k, v] in the output's dtype."""
    query, key, value = _qkv(dtype)
    rounded = attention_op.bfloat16_operands(query)
    assert rounded == (dtype == torch.float32)
    mask = torch.ones(1, 1, 128, 128, device="tpu", dtype=torch.bool) if masked else None
    key_data = torch_pallas.seeds.key_data(seed=3, device="tpu")
    options = (0.1, "threefry", not masked, 0.125, False)
    saved = [(QUERY, torch.bfloat16) if rounded else ((0,), dtype)] * 3
    out, lse, *operands = check_kernel_op(attention_op._compute_attention, (
        query, key, value, mask, key_data, *options, None, None, rounded), "attention_forward",
        [(QUERY, dtype), (LSE, torch.float32), *saved])
    check_kernel_op(attention_op._compute_attention_backward, (
        out, *(operands if rounded else (query, key, value)), mask, out, lse, key_data, *options, None, False),
        "attention_backward", [(QUERY, dtype)] * 3)


def test_attention_backward_formula_dispatches_its_backward_with_the_forward_key(fake):
    query, key, value = _qkv()
    key_data = torch_pallas.seeds.key_data(seed=5, device="tpu")
    inputs = (query, key, value, None, key_data, 0.25, "threefry", True, 0.125, False, None, None, True, None)
    output = attention_op.attention(*inputs)
    (grad_q, grad_k, grad_v, *no_grads), args = check_formula_dispatches(
        attention_op._setup_context, attention_op._backward, inputs, output,
        (torch.randn(QUERY, device="tpu"), None), "torch_pallas::attention_backward")
    assert args[7] is key_data and args[8:10] == (0.25, "threefry")
    # A float32 forward on a TPU saved its operands rounded (attention_op.bfloat16_operands).
    assert [operand.dtype for operand in args[1:4]] == [torch.bfloat16] * 3
    for grad in (grad_q, grad_k, grad_v):
        check_on_tpu(grad, QUERY, torch.float32)
    assert all(grad is None for grad in no_grads)


def test_indrnn_and_its_module_dispatch_its_op_and_return_tpu_tensors(fake):
    x, weight = torch.randn(T, B, F, device="tpu"), torch.randn(F, device="tpu")
    output, h_n = check_dispatches(lambda: torch_pallas.indrnn(x, weight), "torch_pallas::indrnn")
    check_on_tpu(output, (T, B, F), torch.float32)
    check_on_tpu(h_n, (B, F), torch.float32)
    module = torch_pallas.nn.IndRNN(64, F, num_layers=2, device="tpu", dtype=torch.bfloat16)
    x = torch.randn(T, B, 64, device="tpu", dtype=torch.bfloat16)
    output, h_n = check_dispatches(lambda: module(x), "torch_pallas::indrnn", count=2)
    check_on_tpu(output, (T, B, F), torch.bfloat16)
    check_on_tpu(h_n, (2, B, F), torch.bfloat16)


def test_indrnn_kernels_return_their_outputs_through_torchtpu_jax_ops(fake):
    x, weight, h0 = torch.randn(T, B, F, device="tpu"), torch.randn(F, device="tpu"), torch.randn(B, F, device="tpu")
    lengths = torch.full((B,), T, dtype=torch.int32, device="tpu")
    output, h_n = check_kernel_op(indrnn_op._compute_indrnn, (x, weight, h0, lengths, "tanh"), "indrnn_forward",
                                  [((T, B, F), torch.float32), ((B, F), torch.float32)])
    check_kernel_op(indrnn_op._compute_indrnn_backward, (output, h_n, output, weight, h0, None, "relu"),
                    "indrnn_backward", [((T, B, F), torch.float32), ((F,), torch.float32), ((B, F), torch.float32)])


def test_indrnn_backward_formula_dispatches_its_backward(fake):
    x, weight, h0 = torch.randn(T, B, F, device="tpu"), torch.randn(F, device="tpu"), torch.randn(B, F, device="tpu")
    inputs = (x, weight, h0, None, "relu", None)
    output = indrnn_op.indrnn(*inputs)
    (grad_x, grad_weight, grad_h0, *no_grads), args = check_formula_dispatches(
        indrnn_op._setup_context, indrnn_op._backward, inputs, output, (torch.randn(T, B, F, device="tpu"), None),
        "torch_pallas::indrnn_backward")
    assert args[2] is output[0] and args[6] == "relu"
    check_on_tpu(grad_x, (T, B, F), torch.float32)
    check_on_tpu(grad_weight, (F,), torch.float32)
    check_on_tpu(grad_h0, (B, F), torch.float32)
    assert all(grad is None for grad in no_grads)
