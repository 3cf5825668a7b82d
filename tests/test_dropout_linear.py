"""torch_pallas.dropout_linear: ``F.linear(dropout(x), weight, bias)`` in one kernel equals the
unfused call with the same seed (values, the three gradients, the mask), keeps ``x`` and not the
dropped copy (shared by the layers that drop one ``x``), falls back where no kernel takes the
pair, compiles without graph breaks, and runs under torch.func."""

import pytest
import torch
import torch.nn.functional as F
import torch_xla
import torch_xla.debug.metrics as met

import torch_pallas
from conftest import read_together
from reference import SEEDS

DEVICE = torch_xla.device()
# LoRA's down-projection of a (batch, tokens, features) activation; rows that end inside a tile.
X_SHAPE, N = (2, 50, 256), 16
IMPLS = [pytest.param(None, id="default-tiled"), pytest.param("threefry", id="threefry")]


def operands(dtype=torch.float32, x_shape=X_SHAPE, n=N):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(x_shape, generator=generator).to(dtype)
    weight = (torch.randn(n, x_shape[-1], generator=generator) / 16).to(dtype)
    bias = torch.randn(n, generator=generator).to(dtype)
    grad = torch.randn(*x_shape[:-1], n, generator=generator).to(dtype)
    return [t.to(DEVICE) for t in (x, weight, bias, grad)]


def run(function, x, weight, bias, grad):
    leaves = [t.detach().clone().requires_grad_() for t in (x, weight, bias)]
    out = function(*leaves)
    out.backward(grad)
    return read_together([out.detach(), *(leaf.grad for leaf in leaves)])[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", IMPLS)
def test_values_gradients_and_mask_are_the_unfused_ones(impl, dtype):
    x, weight, bias, grad = operands(dtype)
    fused = run(lambda x, w, b: torch_pallas.dropout_linear(x, w, b, 0.3, seed=SEEDS[2], impl=impl),
                x, weight, bias, grad)
    unfused = run(lambda x, w, b: F.linear(torch_pallas.dropout(x, 0.3, seed=SEEDS[2], impl=impl), w, b),
                  x, weight, bias, grad)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for name, got, want in zip(("output", "x.grad", "weight.grad", "bias.grad"), fused, unfused):
        assert got.dtype == want.dtype == dtype and got.shape == want.shape, name
        torch.testing.assert_close(got, want, **tolerance, msg=name)
    # The mask: x's gradient is zero exactly where the dropout dropped.
    assert torch.equal(fused[1] == 0, unfused[1] == 0)


def test_keeps_x_and_not_the_dropped_copy_and_consumers_of_one_x_share_it():
    """docs/transformers.md (LoRA): q, k and v dropping one x with their own keys keep that x once."""
    x, weight, _, _ = operands()
    x.requires_grad_()
    weights = [weight.clone().requires_grad_() for _ in range(3)]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        outputs = [torch_pallas.dropout_linear(x, w, p=0.1) for w in weights]
    assert [tuple(t.shape) for t in saved] == [X_SHAPE, (N, X_SHAPE[-1]), (2,)] * 3
    assert all(t is x for t in saved[::3])
    sum(out.sum() for out in outputs).backward()
    assert x.grad is not None and all(w.grad is not None for w in weights)


@pytest.mark.parametrize("case", ["float64", "lane-dense", "swapped"])
def test_pairs_no_kernel_takes_are_dropout_then_linear(case):
    """A kernel takes x's rows only where they are the dropout's own view of x (not a lane-dense view
    of 100 features, nor ViT-like (B, L, C) seen with B and L swapped); the rest is the unfused call,
    with the same mask (float64's the float32 mask, as dropout's)."""
    x_shape, dtype = {"float64": (X_SHAPE, torch.float64), "lane-dense": ((4, 8, 100), torch.float32),
                      "swapped": ((16, 5, 256), torch.float32)}[case]
    x, weight, bias, grad = operands(dtype, x_shape)
    fused = run(lambda x, w, b: torch_pallas.dropout_linear(x, w, b, 0.3, seed=5), x, weight, bias, grad)
    unfused = run(lambda x, w, b: F.linear(torch_pallas.dropout(x, 0.3, seed=5), w, b), x, weight, bias, grad)
    for got, want in zip(fused, unfused):
        assert torch.equal(got, want)


def test_without_dropout_it_is_linear_and_its_bad_input():
    x, weight, bias, _ = operands()
    for p, training in ((0.0, True), (0.5, False)):
        assert torch.equal(torch_pallas.dropout_linear(x, weight, bias, p, training).cpu(),
                           F.linear(x, weight, bias).cpu())
    assert torch.equal(torch_pallas.dropout_linear(x, weight, bias, 1.0).cpu(),
                       bias.cpu().expand(*X_SHAPE[:-1], N))
    with pytest.raises(TypeError, match="weight must have x's dtype"):
        torch_pallas.dropout_linear(x, weight.bfloat16(), p=0.5)
    with pytest.raises(TypeError, match="bias must have x's dtype"):
        torch_pallas.dropout_linear(x, weight, bias.double(), p=0.5)
    with pytest.raises(ValueError, match="weight must be on x's device"):
        torch_pallas.dropout_linear(x, weight.cpu(), p=0.5)
    with pytest.raises(ValueError, match=r"weight must be \(N, K\)"):
        torch_pallas.dropout_linear(x, weight[:, :7], p=0.5)
    with pytest.raises(ValueError, match=r"bias must be \(16,\)"):
        torch_pallas.dropout_linear(x, weight, bias[:3], p=0.5)
    with pytest.raises(TypeError, match="weight must be a torch.Tensor"):
        torch_pallas.dropout_linear(x, weight.cpu().numpy(), p=0.5)
    with pytest.raises(ValueError, match="p must be in"):
        torch_pallas.dropout_linear(x, weight, p=1.5)


def test_compiles_without_graph_breaks_or_recompiles():
    x, weight, bias, _ = operands()
    weight.requires_grad_()
    step = torch.compile(lambda x, w, b: torch_pallas.dropout_linear(x, w, b, 0.5), backend="openxla", fullgraph=True)
    compiles, outputs = [], []
    for _ in range(3):
        weight.grad = None
        out = step(x, weight, bias)
        out.sum().backward()
        torch_xla.sync()
        outputs.append(out.detach().cpu())
        compiles.append(met.metric_data("CompileTime")[0])
    assert compiles[1] == compiles[-1], compiles
    assert not torch.equal(outputs[1], outputs[2])  # a fresh key per call


def test_torch_func_grad_and_cpu_tensors():
    x, weight, bias, _ = operands()
    fused = torch.func.grad(lambda w: torch_pallas.dropout_linear(x, w, bias, 0.3, seed=2).square().sum())(weight)
    unfused = torch.func.grad(lambda w: F.linear(torch_pallas.dropout(x, 0.3, seed=2), w, bias).square().sum())(weight)
    torch.testing.assert_close(fused.cpu(), unfused.cpu(), rtol=1e-5, atol=1e-5)
    on_cpu = torch_pallas.dropout_linear(x.cpu(), weight.cpu(), bias.cpu(), 0.3, seed=2)
    torch.testing.assert_close(on_cpu, torch_pallas.dropout_linear(x, weight, bias, 0.3, seed=2).cpu(),
                               rtol=1e-6, atol=1e-6)
