"""torch_pallas.indrnn against a float64 loop: outputs and every gradient, many shapes."""

import pytest
import torch
import torch_xla
import torch_xla.debug.metrics as met

import torch_pallas
from conftest import on_a_device_without_front_end
from reference import indrnn_reference, indrnn_reference_gradients, indrnn_reference_with_lengths, random_case


def relative_error(got, expected):
    expected = torch.as_tensor(expected).double()
    return ((got.detach().double().cpu() - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def check_against_reference(x, weight, h0, grad_output, grad_h_n, nonlinearity, batch_first=False, device=None):
    output, h_n = indrnn_reference(x, weight, h0, nonlinearity)
    expected_grads = indrnn_reference_gradients(output, weight, h0, grad_output, grad_h_n, nonlinearity)

    device = device or torch_xla.device()
    ours = [t.float().to(device).requires_grad_() for t in (x, weight, h0)]
    x_in = ours[0].transpose(0, 1) if batch_first else ours[0]
    got_output, got_h_n = torch_pallas.indrnn(x_in, ours[1], ours[2], nonlinearity=nonlinearity,
                                              batch_first=batch_first)
    if batch_first:
        got_output = got_output.transpose(0, 1)
    g_out, g_hn = grad_output.float().to(device), grad_h_n.float().to(device)
    ((got_output * g_out).sum() + (got_h_n * g_hn).sum()).backward()

    assert relative_error(got_output, output) <= 1e-5
    assert relative_error(got_h_n, h_n) <= 1e-5
    for got, expected in zip(ours, expected_grads):
        assert relative_error(got.grad, expected) <= 1e-4


@pytest.mark.parametrize("nonlinearity", ["relu", "tanh"])
@pytest.mark.parametrize("shape", [(16, 8, 128), (37, 3, 200), (1, 4, 130)], ids=["aligned", "unaligned", "T=1"])
def test_matches_float64_loop(shape, nonlinearity):
    check_against_reference(*random_case(shape), nonlinearity)


def test_cpu_tensors_run_the_same_kernels_through_jax():
    """docs/tensors.md, Plain CPU tensors: indrnn on the CPU."""
    check_against_reference(*random_case((37, 3, 200)), "tanh", device="cpu")


def test_batch_first():
    check_against_reference(*random_case((9, 5, 130)), "tanh", batch_first=True)


@pytest.mark.slow  # the kernels at this shape: tests/kernels/test_indrnn.py::test_benchmark_shape
def test_benchmark_shape():
    # The public benchmark's case: T = 1000, F = 1000, B = 1, relu, w = 1, h0 = 0.
    x, _, _, grad_output, grad_h_n = random_case((1000, 1, 1000))
    check_against_reference(x, torch.ones(1000, dtype=torch.float64), torch.zeros(1, 1000, dtype=torch.float64),
                            grad_output, grad_h_n, "relu")


def test_h0_defaults_to_zeros_and_unused_outputs_get_no_gradient():
    x, weight, _, _, _ = random_case((8, 2, 128))
    device = torch_xla.device()
    x, weight = x.float().to(device).requires_grad_(), weight.float().to(device).requires_grad_()
    output, h_n = torch_pallas.indrnn(x, weight)
    reference_output, _ = indrnn_reference(x.detach().cpu(), weight.detach().cpu(), torch.zeros(2, 128), "relu")
    assert relative_error(output, reference_output) <= 1e-5
    h_n.sum().backward()  # output unused: its gradient is zero
    assert x.grad.shape == x.shape and torch.isfinite(x.grad.cpu()).all()


def test_bfloat16_input_keeps_dtype_and_tracks_reference():
    x, weight, h0, _, _ = random_case((16, 8, 128))
    device = torch_xla.device()
    output, h_n = torch_pallas.indrnn(x.to(device, torch.bfloat16), weight.float().to(device),
                                      h0.to(device, torch.bfloat16), nonlinearity="tanh")
    assert output.dtype == torch.bfloat16 and h_n.dtype == torch.bfloat16
    reference_output, _ = indrnn_reference(x.to(torch.bfloat16).double(), weight, h0.to(torch.bfloat16).double(), "tanh")
    assert relative_error(output, reference_output) <= 2e-2


@pytest.mark.parametrize("nonlinearity", ["relu", "tanh"])
def test_lengths_match_float64_loop_per_sequence(nonlinearity):
    x, weight, h0, grad_output, grad_h_n = random_case((37, 3, 200), weight_range=(-1.0, 1.0))
    lengths = [37, 0, 12]
    expected = indrnn_reference_with_lengths(x, weight, h0, lengths, grad_output, grad_h_n, nonlinearity)
    device = torch_xla.device()
    ours = [t.float().to(device).requires_grad_() for t in (x, weight, h0)]
    output, h_n = torch_pallas.indrnn(*ours, nonlinearity=nonlinearity, lengths=lengths)
    ((output * grad_output.float().to(device)).sum() + (h_n * grad_h_n.float().to(device)).sum()).backward()
    for got, wanted, rtol in zip((output, h_n, *(t.grad for t in ours)),
                                 (expected[0], expected[1], expected[2], expected[3], expected[4]),
                                 (1e-5, 1e-5, 1e-4, 1e-4, 1e-4)):
        assert relative_error(got, wanted) <= rtol
    assert not output.detach().cpu()[:, 1].any() and not output.detach().cpu()[12:, 2].any()


def test_new_lengths_reuse_the_compiled_kernels():
    """docs/limits.md, IndRNN and torch.nn.RNN: indrnn(padded, w, lengths=...) takes the lengths as data."""
    device = torch_xla.device()
    x, weight = torch.randn(9, 4, 128).to(device), torch.rand(128).to(device)
    torch_xla.sync()  # what earlier tests left pending is not part of the graphs counted below
    outputs = []
    for lengths in ([9, 1, 4, 0], [2, 9, 9, 3], torch.tensor([5, 5, 5, 5])):
        output, h_n = torch_pallas.indrnn(x, weight, lengths=lengths)
        outputs.append(output)
        torch_xla.sync()
        if len(outputs) == 1:
            met.clear_all()
    assert met.metric_data("CompileTime") is None, "new lengths compiled a new graph"
    torch.testing.assert_close(outputs[2].cpu()[:5], torch_pallas.indrnn(x[:5], weight)[0].cpu(), rtol=0, atol=0)


def test_empty_sequence_returns_h0():
    device = torch_xla.device()
    h0 = torch.randn(2, 128).to(device)
    output, h_n = torch_pallas.indrnn(torch.empty(0, 2, 128, device=device), torch.rand(128).to(device), h0)
    assert output.shape == (0, 2, 128) and torch.equal(h_n.cpu(), h0.cpu())


def _xla(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype, device=torch_xla.device())


@pytest.mark.parametrize("call,error,match", [
    (lambda: torch_pallas.indrnn(_xla(4, 2, 8), _xla(7)), ValueError, r"weight must have shape \(8,\)"),
    (lambda: torch_pallas.indrnn(_xla(4, 2, 8), _xla(8), _xla(3, 8)), ValueError, r"h0 must have shape \(2, 8\)"),
    (lambda: torch_pallas.indrnn(_xla(4, 2, 8), _xla(8), _xla(4, 2, 8)), ValueError, "h0 must have shape"),
    (lambda: torch_pallas.indrnn(_xla(4, 8), _xla(8)), ValueError, "3-D"),
    (lambda: torch_pallas.indrnn(_xla(4, 2, 8), _xla(1, 8)), ValueError, "weight must have shape"),
    (lambda: torch_pallas.indrnn(_xla(4, 2, 8), _xla(8), nonlinearity="sigmoid"), ValueError, "nonlinearity"),
    (lambda: torch_pallas.indrnn(_xla(4, 2, 8, dtype=torch.int32), _xla(8)), TypeError, "x must be float32"),
    (lambda: torch_pallas.indrnn(_xla(4, 2, 8), _xla(8, dtype=torch.int64)), TypeError, "weight must be float32"),
    (lambda: torch_pallas.indrnn(on_a_device_without_front_end(4, 2, 8), _xla(8)), ValueError,
     r"x\.to\(torch_xla\.device\(\)\)"),
    (lambda: torch_pallas.indrnn([[[0.0]]], _xla(1)), TypeError, "x must be a torch.Tensor"),
    (lambda: torch_pallas.indrnn(_xla(4, 2, 8), _xla(8), lengths=[4]), ValueError, r"lengths must have shape \(2,\)"),
    (lambda: torch_pallas.indrnn(_xla(4, 2, 8), _xla(8), lengths=[4, 5]), ValueError, r"lengths must be in \[0, 4\]"),
    (lambda: torch_pallas.indrnn(_xla(4, 2, 8), _xla(8), lengths=[-1, 2]), ValueError, r"lengths must be in"),
    (lambda: torch_pallas.indrnn(_xla(4, 2, 8), _xla(8), lengths=[1.5, 2.0]), TypeError, "lengths must hold integers"),
    (lambda: torch_pallas.indrnn(_xla(4, 2, 8), _xla(8), lengths="ab"), TypeError, "lengths must be a tensor"),
])
def test_bad_input_raises(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_torch_func_grad_and_vjp_match_autograd_and_jvp_raises():
    x, weight, h0, grad_output, _ = (t.float().to(torch_xla.device()) for t in random_case((5, 3, 130)))

    def loss(x, weight):
        return (torch_pallas.indrnn(x, weight, h0, nonlinearity="tanh")[0] * grad_output).sum()

    grads = torch.func.grad(loss, argnums=(0, 1))(x, weight)
    _, vjp = torch.func.vjp(loss, x, weight)
    leaves = [t.clone().requires_grad_() for t in (x, weight)]
    loss(*leaves).backward()
    for got in (grads, vjp(torch.ones((), device=x.device))):
        for g, leaf in zip(got, leaves):
            torch.testing.assert_close(g.cpu(), leaf.grad.cpu())
    with pytest.raises(NotImplementedError, match="forward-mode"):
        torch.func.jvp(lambda x: torch_pallas.indrnn(x, weight)[0], (x,), (x,))
