"""torch_pallas.indrnn and nn.IndRNN on torchax tensors: outputs and every gradient against
the float64 loop, under torch's autograd and under ``jax.jit(jax.grad(...))`` of a torch
function, lengths as data, and the module against the same module on CPU tensors."""

import copy

import jax
import numpy as np
import pytest
import torch
import torchax

import torch_pallas
from reference import indrnn_reference, indrnn_reference_gradients, indrnn_reference_with_lengths, random_case

ENV = torchax.default_env()


def values(tensor):
    return np.asarray(tensor.detach()._elem) if isinstance(tensor, torchax.tensor.Tensor) else tensor.detach().numpy()


def relative_error(got, expected):
    got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
    return float(np.linalg.norm(got - expected) / max(np.linalg.norm(expected), 1e-30))


def on_jax(tensor):
    with ENV:
        return tensor.float().to("jax")


@pytest.mark.parametrize("nonlinearity", ["relu", "tanh"])
@pytest.mark.parametrize("shape", [(16, 8, 128), (13, 3, 200)], ids=["aligned", "unaligned"])
def test_autograd_matches_float64_loop(shape, nonlinearity):
    x, weight, h0, grad_output, grad_h_n = random_case(shape)
    expected, expected_h_n = indrnn_reference(x, weight, h0, nonlinearity)
    expected_grads = indrnn_reference_gradients(expected, weight, h0, grad_output, grad_h_n, nonlinearity)
    ours = [on_jax(t).requires_grad_() for t in (x, weight, h0)]
    with ENV:
        output, h_n = torch_pallas.indrnn(*ours, nonlinearity=nonlinearity)
        assert isinstance(output, torchax.tensor.Tensor)
        ((output * on_jax(grad_output)).sum() + (h_n * on_jax(grad_h_n)).sum()).backward()
    assert relative_error(values(output), expected) <= 1e-5 and relative_error(values(h_n), expected_h_n) <= 1e-5
    for got, wanted in zip(ours, expected_grads):
        assert relative_error(values(got.grad), wanted) <= 1e-4


def test_jax_grad_of_a_torch_function_under_jit_matches_float64_loop_with_lengths_as_data():
    x, weight, h0, grad_output, grad_h_n = random_case((13, 3, 200), weight_range=(-1.0, 1.0))

    def loss(x, weight, h0, lengths):
        tensors = [torchax.tensor.Tensor(array, ENV) for array in (x, weight, h0, lengths)]
        with ENV:
            output, h_n = torch_pallas.indrnn(*tensors[:3], nonlinearity="tanh", lengths=tensors[3])
            total = (output * on_jax(grad_output)).sum() + (h_n * on_jax(grad_h_n)).sum()
            return total._elem

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    arrays = [on_jax(t)._elem for t in (x, weight, h0)]
    for lengths in ([13, 0, 7], [5, 13, 13]):
        grads = step(*arrays, jax.numpy.asarray(lengths, jax.numpy.int32))
        expected = indrnn_reference_with_lengths(x, weight, h0, lengths, grad_output, grad_h_n, "tanh")
        for got, wanted in zip(grads, expected[2:]):
            assert relative_error(got, wanted) <= 1e-4
    assert step._cache_size() == 1  # new lengths: no retrace


def test_module_under_jax_grad_equals_the_same_module_on_cpu_tensors():
    """torchax runs F.linear at torch-function level, above torch's autograd (nothing is
    recorded for it), so a module with linear layers trains on torchax through JAX's
    gradients of a functional call, as torchax's training helpers do."""
    torch.manual_seed(0)
    module = torch_pallas.nn.IndRNN(24, 128, num_layers=2, bidirectional=True, batch_first=True)
    x = torch.randn(3, 9, 24, requires_grad=True)
    expected, expected_h_n = module(x)
    (expected.square().sum() + expected_h_n.sum()).backward()
    on_device = copy.deepcopy(module)
    with ENV:
        on_device = on_device.to("jax")
        params = {name: parameter.detach()._elem for name, parameter in on_device.named_parameters()}
        x_array = x.detach().to("jax")._elem

    def loss(params, x):
        with ENV:
            tensors = {name: torchax.tensor.Tensor(array, ENV) for name, array in params.items()}
            output, h_n = torch.func.functional_call(on_device, tensors, (torchax.tensor.Tensor(x, ENV),))
            return (output.square().sum() + h_n.sum())._elem, (output._elem, h_n._elem)

    (_, (output, h_n)), (grads, x_grad) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        params, x_array)
    np.testing.assert_allclose(np.asarray(output), values(expected), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(h_n), values(expected_h_n), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(x_grad), values(x.grad), atol=1e-4, rtol=1e-4)
    for name, parameter in module.named_parameters():
        np.testing.assert_allclose(np.asarray(grads[name]), values(parameter.grad), atol=1e-4, rtol=1e-4,
                                   err_msg=name)
