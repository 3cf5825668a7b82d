"""The rest of the dropout family on fake ``tpu`` tensors: dropout_matmul and dropout_linear (their
kernels through TorchTPU's jax_op, their backward formulas), the channel dropouts, the nn modules,
convert_dropout, and keys from a generator."""

import pytest
import torch

import torch_pallas
from torchtpu_support import DispatchedOps, check_dispatches, check_formula_dispatches, check_kernel_op, check_on_tpu
from torch_pallas.ops import dropout_linear as dropout_linear_op, dropout_matmul as dropout_matmul_op

WEIGHTS, VALUE = (2, 4, 128, 128), (2, 4, 128, 64)
# LoRA's down-projection: (batch, tokens, features) through a rank-16 weight.
X, LORA_A, LORA_OUT = (2, 128, 256), (16, 256), (2, 128, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_matmul_dispatches_its_op_and_returns_a_tpu_tensor(fake, dtype):
    weights, value = torch.randn(WEIGHTS, device="tpu", dtype=dtype), torch.randn(VALUE, device="tpu", dtype=dtype)
    y = check_dispatches(lambda: torch_pallas.dropout_matmul(weights, value, 0.1, seed=1),
                         "torch_pallas::dropout_matmul")
    check_on_tpu(y, VALUE, dtype)


def test_dropout_matmul_kernels_reach_torchtpu_as_jax_ops(fake):
    """Forward (one output) and backward (two: a list back from the front end's tuple)."""
    weights, value, grad = (torch.randn(shape, device="tpu") for shape in (WEIGHTS, VALUE, VALUE))
    key = torch_pallas.seeds.key_data(seed=3, device="tpu")
    check_kernel_op(dropout_matmul_op._compute_dropout_matmul, (weights, value, key, 0.1, "threefry", True),
                    "dropout_matmul_forward", [(VALUE, torch.float32)])
    check_kernel_op(dropout_matmul_op._compute_dropout_matmul_backward, (grad, weights, value, key, 0.1, "threefry"),
                    "dropout_matmul_backward", [(WEIGHTS, torch.float32), (VALUE, torch.float32)])


def test_dropout_matmul_backward_formula_dispatches_its_backward_with_the_forward_key(fake):
    weights, value, grad = (torch.randn(shape, device="tpu") for shape in (WEIGHTS, VALUE, VALUE))
    key = torch_pallas.seeds.key_data(seed=5, device="tpu")
    inputs = (weights, value, key, 0.25, "threefry", False)
    output = dropout_matmul_op.dropout_matmul(*inputs)
    (grad_weights, grad_value, *no_grads), args = check_formula_dispatches(
        dropout_matmul_op._setup_context, dropout_matmul_op._backward, inputs, output, (grad,),
        "torch_pallas::dropout_matmul_backward")
    assert args[3] is key and args[4:6] == (0.25, "threefry")
    check_on_tpu(grad_weights, WEIGHTS, torch.float32)
    check_on_tpu(grad_value, VALUE, torch.float32)
    assert all(grad is None for grad in no_grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_linear_dispatches_its_op_and_returns_a_tpu_tensor(fake, dtype):
    x, weight = torch.randn(X, device="tpu", dtype=dtype), torch.randn(LORA_A, device="tpu", dtype=dtype)
    y = check_dispatches(lambda: torch_pallas.dropout_linear(x, weight, p=0.1, seed=1), "torch_pallas::dropout_linear")
    check_on_tpu(y, LORA_OUT, dtype)


def test_dropout_linear_kernels_reach_torchtpu_as_jax_ops(fake):
    """The default impl's forward (one output) and backward (x's gradient and the weight's, float32
    from the kernel; the op rounds it to the weight's dtype)."""
    x, weight, grad = (torch.randn(shape, device="tpu") for shape in (X, LORA_A, LORA_OUT))
    key = torch_pallas.seeds.key_data(seed=3, device="tpu")
    check_kernel_op(dropout_linear_op._compute_dropout_linear, (x, weight, key, 0.1, "tiled"),
                    "dropout_linear_forward", [(LORA_OUT, torch.float32)])
    check_kernel_op(dropout_linear_op._compute_dropout_linear_backward, (grad, x, weight, key, 0.1, "tiled"),
                    "dropout_linear_backward", [(X, torch.float32), (LORA_A, torch.float32)])


def test_dropout_linear_backward_formula_dispatches_its_backward_with_the_forward_key(fake):
    x, weight, grad = (torch.randn(shape, device="tpu") for shape in (X, LORA_A, LORA_OUT))
    key = torch_pallas.seeds.key_data(seed=5, device="tpu")
    inputs = (x, weight, key, 0.25, "tiled")
    output = dropout_linear_op.dropout_linear(*inputs)
    (grad_x, grad_weight, *no_grads), args = check_formula_dispatches(
        dropout_linear_op._setup_context, dropout_linear_op._backward, inputs, output, (grad,),
        "torch_pallas::dropout_linear_backward")
    assert args[1] is x and args[3] is key and args[4:6] == (0.25, "tiled")
    check_on_tpu(grad_x, X, torch.float32)
    check_on_tpu(grad_weight, LORA_A, torch.float32)
    assert all(grad is None for grad in no_grads)


CHANNEL_DROPOUTS = {
    "dropout1d": (torch_pallas.dropout1d, torch_pallas.nn.Dropout1d, (4, 16, 128)),
    "dropout2d": (torch_pallas.dropout2d, torch_pallas.nn.Dropout2d, (4, 16, 8, 128)),
    "dropout3d": (torch_pallas.dropout3d, torch_pallas.nn.Dropout3d, (4, 16, 2, 8, 128)),
}


@pytest.mark.parametrize("name", CHANNEL_DROPOUTS)
def test_channel_dropouts_and_their_modules_draw_one_torch_pallas_mask(fake, name):
    function, module, shape = CHANNEL_DROPOUTS[name]
    x = torch.randn(shape, device="tpu", dtype=torch.bfloat16)
    for call in (lambda: function(x, 0.2, seed=1), lambda: function(x, 0.2), lambda: module(0.2)(x)):
        check_on_tpu(check_dispatches(call, "torch_pallas::dropout"), shape, torch.bfloat16)


def test_the_dropout_module_draws_from_the_tpu_generator(fake):
    x = torch.randn(8, 128, device="tpu")
    y = check_dispatches(lambda: torch_pallas.nn.Dropout(0.1)(x), "torch_pallas::dropout")
    check_on_tpu(y, x.shape, x.dtype)


def test_convert_dropout_on_a_model_built_on_the_tpu_device(fake):
    """(Built with ``device="tpu"``: ``Module.to("tpu")`` fails under fake mode.)"""
    model = torch.nn.Sequential(torch.nn.Linear(128, 128, device="tpu"), torch.nn.Dropout(0.1),
                                torch.nn.Linear(128, 128, device="tpu"), torch.nn.Dropout1d(0.1))
    converted = torch_pallas.convert_dropout(model)
    assert isinstance(converted[1], torch_pallas.nn.Dropout) and isinstance(converted[3], torch_pallas.nn.Dropout1d)
    x = torch.randn(4, 8, 128, device="tpu")
    check_on_tpu(check_dispatches(lambda: converted(x), "torch_pallas::dropout", count=2), x.shape, x.dtype)


class _TPUGenerator(torch.Generator):
    """A CPU generator that says it is on the ``tpu`` device (TorchTPU makes a real one only
    with a TPU): what torch_pallas checks and where it draws, under fake mode."""

    @property
    def device(self):
        return torch.device("tpu")


def test_a_tpu_generator_is_drawn_from_on_its_device(fake):
    x = torch.randn(8, 128, device="tpu")
    generator = _TPUGenerator()
    with DispatchedOps() as dispatched:
        key = torch_pallas.seeds.key_data(generator=generator, device="tpu")
    assert dispatched.names[0] == "aten::randint" and "aten::_to_copy" not in dispatched.names, dispatched.names
    check_on_tpu(key, (2,), torch.int32)
    check_on_tpu(check_dispatches(lambda: torch_pallas.dropout(x, 0.1, generator=generator), "torch_pallas::dropout"),
                 x.shape, x.dtype)
    check_on_tpu(torch_pallas.dropout(x, 0.1, generator=torch.Generator().manual_seed(1)), x.shape, x.dtype)




@pytest.mark.xfail(raises=RuntimeError, strict=True,
                   reason="TorchTPU makes a tpu torch.Generator only with a TPU ('No jellyfish device found')")
def test_a_real_tpu_generator_keys_a_call(fake):
    generator = torch.Generator("tpu").manual_seed(1)
    x = torch.randn(8, 128, device="tpu")
    check_on_tpu(torch_pallas.dropout(x, 0.1, generator=generator), x.shape, x.dtype)


def test_a_generator_on_another_device_is_refused_naming_those_taken():
    class MetaGenerator(torch.Generator):
        device = torch.device("meta")

    with pytest.raises(ValueError, match=r"generator must be a CPU or TorchTPU \('tpu'\) torch.Generator "
                                         r"\(got one on meta\); to follow torch.manual_seed instead"):
        torch_pallas.seeds.check_source(generator=MetaGenerator())
