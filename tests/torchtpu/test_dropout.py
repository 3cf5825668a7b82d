"""torch_pallas.dropout on fake ``tpu`` tensors: the op dispatched, what it returns, the kernel
it hands TorchTPU, its backward formula, and bad input."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import torch_pallas
from torchtpu_support import DispatchedOps, check_on_tpu, run_formula, torch_noise_ops
from torch_pallas import frontends
from torch_pallas.ops import dropout as dropout_op

SHAPE = (64, 256)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_dispatches_torch_pallas_dropout_and_returns_a_tpu_tensor(fake, dtype):
    x = torch.randn(SHAPE, device="tpu", dtype=dtype)
    for source in (dict(seed=1), {}):
        with DispatchedOps() as dispatched:
            y = torch_pallas.dropout(x, 0.1, **source)
        assert dispatched.names.count("torch_pallas::dropout") == 1, dispatched.names
        assert not torch_noise_ops(dispatched.names), dispatched.names
        check_on_tpu(y, x.shape, dtype)


def test_the_op_hands_torchtpu_a_jax_op_exported_for_tpu(fake):
    """What the op runs on a ``tpu`` tensor (its computation; under fake mode torch runs its
    fake function instead): the kernel as a custom op TorchTPU's ``jax_op`` made, whose fake
    function exports it for TPU and returns a ``tpu`` tensor."""
    x = torch.randn(SHAPE, device="tpu", dtype=torch.bfloat16)
    key = torch_pallas.seeds.key_data(seed=3, device="tpu")
    with DispatchedOps() as dispatched:
        y = dropout_op._compute_dropout(x, key, 0.1, "threefry", False, None, None)
    assert len(dispatched.names) == 1 and dispatched.names[0].startswith("torch_pallas_tpu::dropout_")
    assert (y.shape, y.dtype, y.device.type) == (x.shape, x.dtype, "tpu")


def test_the_backward_formula_dispatches_the_same_kernel_with_the_forward_key(fake):
    """The backward regenerates the forward's mask: dropout of the gradient with the forward's
    key data (the formula run directly: the autograd engine crashes on fake tpu tensors)."""
    x = torch.randn(SHAPE, device="tpu")
    key = torch_pallas.seeds.key_data(seed=5, device="tpu")
    inputs = (x, key, 0.25, "threefry", False, None, None, None)
    output = dropout_op.dropout(*inputs)
    grad_output = torch.randn(SHAPE, device="tpu")
    seen = []

    class KeyOfEachDropout(DispatchedOps):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._schema.name == "torch_pallas::dropout":
                seen.append(args[1])
            return super().__torch_dispatch__(func, types, args, kwargs)

    with KeyOfEachDropout() as dispatched:
        grad_x, *no_grads = run_formula(dropout_op._setup_context, dropout_op._backward, inputs, output, grad_output)
    assert dispatched.names == ["torch_pallas::dropout"] and seen == [key]
    assert (grad_x.shape, grad_x.dtype, grad_x.device.type) == (SHAPE, torch.float32, "tpu")
    assert all(grad is None for grad in no_grads)


@pytest.mark.parametrize("call, error, match", [
    (lambda x: torch_pallas.dropout(x, 1.5), ValueError, "p must be in"),
    (lambda x: torch_pallas.dropout(x, 0.5, impl="philox"), ValueError, "impl"),
    (lambda x: torch_pallas.dropout(x, 0.5, impl="hardware"), ValueError, "hardware"),
    (lambda x: torch_pallas.dropout(x, 0.5, seed=-1), ValueError, "seed"),
    (lambda x: torch_pallas.dropout(x, 0.5, seed=1, generator=torch.Generator()), ValueError, "not both"),
    (lambda x: torch_pallas.dropout(x.int(), 0.5), TypeError, "x must be"),
    (lambda x: torch_pallas.dropout_add(x, x[:2], 0.5), ValueError, "residual"),
])
def test_bad_input_raises_as_on_the_other_stacks_before_any_kernel(fake, monkeypatch, call, error, match):
    x = torch.randn(SHAPE, device="tpu")

    def no_kernel(*args, **kwargs):
        raise AssertionError("a kernel ran")

    monkeypatch.setattr(frontends.torchtpu, "call", no_kernel)
    with pytest.raises(error, match=match):
        call(x)


def test_a_device_torchtpu_has_no_front_end_for_is_named_with_the_fix(fake):
    with FakeTensorMode():
        x = torch.randn(SHAPE, device="cuda")  # made without CUDA
    with pytest.raises(ValueError, match=r"TorchTPU device \('tpu'\) or the CPU: move it with x.to\('tpu'\)"):
        torch_pallas.dropout(x, 0.5, seed=1)
