"""torch_pallas.scaled_dot_product_attention against torch's on XLA tensors (values and
gradients), its dropout against torch_pallas.dropout on the weights, its seeds, errors,
torch.compile, torch.func and checkpointing. The kernels' own tests are in kernels/."""

import pytest
import torch
import torch.nn.functional as F
import torch_xla
import torch_xla.debug.metrics as metrics

import torch_pallas
from attention_cases import CASES
from conftest import read_together
from kernel_calls import record_dropout_keys

DEVICE = torch_xla.device()


def operands(query_shape, key_shape, value_shape, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator, dtype=dtype).to(DEVICE).requires_grad_()
            for shape in (query_shape, key_shape, value_shape)]


def gradients(output, tensors, seed=1):
    weights = torch.randn(output.shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    return torch.autograd.grad((output * weights).sum(), tensors)


@pytest.mark.parametrize("case", CASES)
def test_output_and_gradients_equal_torch(case):
    shapes, options = CASES[case]
    options = {name: value().to(DEVICE) if callable(value) else value for name, value in options.items()}
    tensors = operands(*shapes)
    ours = torch_pallas.scaled_dot_product_attention(*tensors, **options)
    torchs = F.scaled_dot_product_attention(*tensors, **options)
    (ours, *our_gradients), (torchs, *torchs_gradients) = read_together(
        [ours, *gradients(ours, tensors)], [torchs, *gradients(torchs, tensors)])
    torch.testing.assert_close(ours, torchs, atol=2e-6, rtol=1e-5)
    for mine, expected in zip(our_gradients, torchs_gradients):
        torch.testing.assert_close(mine, expected, atol=5e-6, rtol=1e-5)


def test_float_mask_gets_torchs_gradient():
    tensors = operands((2, 3, 24, 16), (2, 3, 40, 16), (2, 3, 40, 16))
    bias = torch.randn(1, 3, 1, 40, generator=torch.Generator().manual_seed(3)).to(DEVICE).requires_grad_()
    ours = torch_pallas.scaled_dot_product_attention(*tensors, attn_mask=bias)
    torchs = F.scaled_dot_product_attention(*tensors, attn_mask=bias)
    for mine, expected in zip(*read_together(gradients(ours, [*tensors, bias]), gradients(torchs, [*tensors, bias]))):
        torch.testing.assert_close(mine, expected, atol=5e-6, rtol=1e-5)


def attention_with_torch_pallas_dropout(query, key, value, dropout_p, seed, is_causal=False):
    scores = query @ key.transpose(-2, -1) / query.shape[-1] ** 0.5
    if is_causal:
        scores = scores.masked_fill(~torch.ones(scores.shape[-2:], dtype=torch.bool).tril().to(DEVICE), float("-inf"))
    return torch_pallas.dropout(torch.softmax(scores, -1), dropout_p, seed=seed, impl="threefry") @ value


# The flash kernels, and 128 tokens of head dim 64 without a mask (kernels.heads_in_lanes).
SHAPES = {"flash": ((2, 3, 24, 16), (2, 3, 40, 16), (2, 3, 40, 8)), "heads-in-lanes": ((2, 2, 128, 64),) * 3}


@pytest.mark.parametrize("shapes", SHAPES)
def test_dropout_is_torch_pallas_dropout_of_the_weights_with_the_same_seed(shapes):
    """docs/noise.md, Attention's mask: with impl="threefry" the fused kernel's mask is the one
    torch_pallas.dropout draws for the weights."""
    tensors = operands(*SHAPES[shapes])
    ours = torch_pallas.scaled_dot_product_attention(*tensors, dropout_p=0.3, is_causal=True, seed=11,
                                                     impl="threefry")
    written_out = attention_with_torch_pallas_dropout(*tensors, 0.3, 11, is_causal=True)
    (ours, *our_gradients), (written_out, *expected_gradients) = read_together(
        [ours, *gradients(ours, tensors)], [written_out, *gradients(written_out, tensors)])
    torch.testing.assert_close(ours, written_out, atol=2e-6, rtol=1e-5)
    for mine, expected in zip(our_gradients, expected_gradients):
        torch.testing.assert_close(mine, expected, atol=5e-6, rtol=1e-5)


def test_keys_follow_torch_pallas_seeds():
    tensors = [t.detach() for t in operands((2, 2, 16, 16), (2, 2, 16, 16), (2, 2, 16, 16))]

    def attend(**source):
        return torch_pallas.scaled_dot_product_attention(*tensors, dropout_p=0.5, **source).cpu()

    assert torch.equal(attend(seed=3), attend(seed=3)) and not torch.equal(attend(seed=3), attend(seed=4))
    assert torch.equal(attend(generator=torch.Generator().manual_seed(5)),
                       attend(generator=torch.Generator().manual_seed(5)))
    torch_xla.manual_seed(6)
    first, second = attend(), attend()
    torch_xla.manual_seed(6)
    assert not torch.equal(first, second) and torch.equal(attend(), first)
    no_dropout = torch_pallas.scaled_dot_product_attention(*tensors)
    torch.testing.assert_close(no_dropout, F.scaled_dot_product_attention(*tensors), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16])  # float16: the kernels' tests
def test_16_bit_inputs_are_close_to_float32(dtype):
    tensors = operands((2, 2, 24, 64), (2, 2, 40, 64), (2, 2, 40, 64))
    low = [t.detach().to(dtype).requires_grad_() for t in tensors]
    out = torch_pallas.scaled_dot_product_attention(*low, dropout_p=0.2, seed=1)
    expected = torch_pallas.scaled_dot_product_attention(*tensors, dropout_p=0.2, seed=1)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)
    grads = gradients(out, low)
    assert all(grad.dtype == dtype and torch.isfinite(grad.float()).all() for grad in grads)


@pytest.mark.parametrize("case", ["bool-mask", "heads-in-lanes-causal"])
def test_float32_operands_go_to_kernels_compiled_for_tpu_as_bfloat16_and_are_saved_so(case, monkeypatch):
    """Where the kernels are compiled for a TPU their products round float32 operands to
    bfloat16 (kernels/attention.py), so query, key and value reach them rounded and the backward
    pass keeps the bfloat16 copies; output and gradients stay float32. Here the interpret-mode
    kernels stand in for the compiled ones: their result is torch's float64 attention of the
    rounded operands, within the bfloat16 rounding of the weights before their product."""
    from torch_pallas import bridge

    monkeypatch.setattr(bridge, "compiles_for_tpu", lambda tensor: True)
    shapes, options = CASES[case]
    options = {name: value() if callable(value) else value for name, value in options.items()}
    tensors = operands(*shapes)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda tensor: saved.append(tensor.dtype) or tensor, lambda t: t):
        out = torch_pallas.scaled_dot_product_attention(
            *tensors, **{name: value.to(DEVICE) if isinstance(value, torch.Tensor) else value
                         for name, value in options.items()})
    assert saved[:3] == [torch.bfloat16] * 3 and out.dtype == torch.float32
    grads = gradients(out, tensors)
    assert all(grad.dtype == torch.float32 for grad in grads)
    (out, *grads), leaves = read_together([out, *grads], tensors)
    rounded = [t.detach().to(torch.bfloat16).double().requires_grad_() for t in leaves]
    expected = F.scaled_dot_product_attention(*rounded, **options)
    torch.testing.assert_close(out.double(), expected, atol=1e-2, rtol=1e-2)
    weights = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1)).double()
    for mine, wanted in zip(grads, torch.autograd.grad((expected * weights).sum(), rounded)):
        torch.testing.assert_close(mine.double(), wanted, atol=3e-2, rtol=2e-2)


def test_float32_operands_stay_float32_in_interpret_mode():
    tensors = operands((2, 2, 24, 16), (2, 2, 40, 16), (2, 2, 40, 16))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda tensor: saved.append(tensor.dtype) or tensor, lambda t: t):
        torch_pallas.scaled_dot_product_attention(*tensors, dropout_p=0.1, seed=1)
    assert saved[:3] == [torch.float32] * 3


def bad(**changes):
    query, key, value = (torch.zeros(2, 2, 8, 4, device=DEVICE) for _ in range(3))
    arguments = dict(query=query, key=key, value=value)
    arguments.update(changes)
    return lambda: torch_pallas.scaled_dot_product_attention(**arguments)


@pytest.mark.parametrize("call, error, match", [
    (bad(query=[[1.0]]), TypeError, "query must be a torch.Tensor"),
    (bad(query=torch.zeros(2, 2, 8, 4, device=DEVICE, dtype=torch.float64)), TypeError, "query must be float32"),
    (bad(key=torch.zeros(2, 2, 8, 4, device=DEVICE, dtype=torch.bfloat16)), TypeError, "one dtype"),
    (bad(attn_mask=torch.zeros(8, 8, device=DEVICE, dtype=torch.int32)), TypeError, "attn_mask must be boolean"),
    (bad(attn_mask=torch.ones(8, 8, device=DEVICE, dtype=torch.bool), is_causal=True), ValueError, "is_causal"),
    (bad(attn_mask=torch.ones(8, 9, device=DEVICE, dtype=torch.bool)), ValueError, "does not broadcast"),
    (bad(key=torch.zeros(2, 2, 8, 5, device=DEVICE)), ValueError, "same last dim"),
    (bad(query=torch.zeros(2, 3, 8, 4, device=DEVICE), enable_gqa=True), ValueError, "multiple"),
    (bad(dropout_p=1.5), ValueError, "dropout_p must be in"),
    (bad(dropout_p="0.1"), TypeError, "dropout_p must be"),
    (bad(scale="2"), TypeError, "scale must be"),
    (bad(dropout_p=0.1, impl="hardware"), ValueError, "needs PJRT_DEVICE=TPU"),
    (bad(dropout_p=0.1, seed=1, generator=torch.Generator()), ValueError, "seed"),
    (bad(key=torch.zeros(2, 2, 8, 4)), ValueError, "one device"),
])
def test_bad_arguments_raise_before_any_kernel_runs(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_empty_shapes_give_torchs_results():
    query, key = torch.zeros(2, 0, 4, device=DEVICE), torch.zeros(2, 3, 4, device=DEVICE)
    assert torch_pallas.scaled_dot_product_attention(query, key, key).shape == (2, 0, 4)
    out = torch_pallas.scaled_dot_product_attention(torch.ones(2, 3, 4, device=DEVICE), query, query)
    assert out.shape == (2, 3, 4) and not out.cpu().any()


@pytest.mark.parametrize("length, head_dim", [(24, 16), (128, 64)], ids=["flash", "heads-in-lanes"])
def test_compiled_fullgraph_draws_fresh_keys_without_recompiling_and_matches_eager_for_a_seed(length, head_dim):
    tensors = operands(*[(2, 2, length, head_dim)] * 3)

    @torch.compile(backend="openxla", fullgraph=True)
    def attend(query, key, value):
        return torch_pallas.scaled_dot_product_attention(query, key, value, dropout_p=0.2, is_causal=True)

    outputs, compiles = [], []
    for _ in range(3):
        out = attend(*tensors)
        out.sum().backward()
        torch_xla.sync()
        outputs.append(out.detach().cpu())
        compiles.append(metrics.metric_data("CompileTime")[0])
    assert compiles[1] == compiles[2], compiles
    assert not torch.equal(outputs[1], outputs[2])  # a fresh mask per call

    seeded = torch.compile(lambda q, k, v: torch_pallas.scaled_dot_product_attention(
        q, k, v, dropout_p=0.2, is_causal=True, seed=9), backend="openxla", fullgraph=True)
    eager = torch_pallas.scaled_dot_product_attention(*tensors, dropout_p=0.2, is_causal=True, seed=9)
    torch.testing.assert_close(seeded(*tensors), eager, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("shape", [(2, 16, 8), (1, 2, 128, 64)], ids=["flash", "heads-in-lanes"])
def test_torch_func_grad_and_no_forward_mode(shape):
    query, key, value = (t.detach() for t in operands(shape, shape, shape))

    def loss(query):
        return torch_pallas.scaled_dot_product_attention(query, key, value, dropout_p=0.3, seed=2).square().sum()

    grad = torch.func.grad(loss)(query)
    query.requires_grad_()
    torch.testing.assert_close(grad, torch.autograd.grad(loss(query), query)[0])
    with pytest.raises(NotImplementedError, match="forward-mode"):
        torch.func.jvp(loss, (query.detach(),), (torch.ones_like(query),))


@pytest.mark.parametrize("length, head_dim", [(24, 16), (128, 64)], ids=["flash", "heads-in-lanes"])
def test_checkpoint_recomputes_the_forwards_attention_mask(monkeypatch, length, head_dim):
    tensors = operands(*[(2, 2, length, head_dim)] * 3)
    keys = record_dropout_keys(monkeypatch)
    out = torch_pallas.checkpoint(
        lambda q, k, v: torch_pallas.scaled_dot_product_attention(q, k, v, dropout_p=0.3), *tensors)
    (forward,) = keys
    out.sum().backward()
    assert keys == [forward] * 3  # the forward, its recomputation and the backward kernels: one key


def test_cpu_tensors_run_the_same_kernels_with_the_xla_devices_result():
    """docs/tensors.md, Plain CPU tensors: attention on the CPU through JAX = the XLA device's, for a seed."""
    query = torch.randn(2, 2, 24, 16, generator=torch.Generator().manual_seed(4)).requires_grad_()
    out = torch_pallas.scaled_dot_product_attention(query, query, query, dropout_p=0.3, seed=4, is_causal=True)
    (grad,) = torch.autograd.grad(out.sum(), query)
    on_xla = query.detach().to(DEVICE).requires_grad_()
    expected = torch_pallas.scaled_dot_product_attention(on_xla, on_xla, on_xla, dropout_p=0.3, seed=4, is_causal=True)
    (expected_grad,) = torch.autograd.grad(expected.sum(), on_xla)
    assert out.device.type == "cpu"
    torch.testing.assert_close(out, expected.cpu(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad, expected_grad.cpu(), atol=1e-5, rtol=1e-5)
