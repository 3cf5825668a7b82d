"""torch.library.opcheck over every custom op, on XLA tensors: schema, fake (meta) function,
and AOT dispatch (which, for inputs that require grad, also compares the registered
backward's gradients with eager mode's).

opcheck's autograd-registration check is left out: in torch 2.9 it runs only on CPU, CUDA
and XPU tensors ("NYI devices other than CPU/CUDA/XPU"), and these ops need XLA tensors."""

import pytest
import torch
import torch_xla

import torch_pallas  # noqa: F401  (registers the ops)
from torch_pallas import seeds


def xla(t):
    return t.to(torch_xla.device())


def key():
    return seeds.key_data(seed=5)


def sequence(*shape, requires_grad=False):
    return xla(torch.randn(*shape, generator=torch.Generator().manual_seed(0))).requires_grad_(requires_grad)


CASES = {
    "sample": (torch.ops.torch_pallas.sample.default, lambda: (key(), [20, 300], "uniform", torch.float32, 0.5, "threefry")),
    "fold_in": (torch.ops.torch_pallas.fold_in.default, lambda: (key(), 3)),
    "dropout": (torch.ops.torch_pallas.dropout.default,
                lambda: (sequence(20, 300, requires_grad=True), key(), 0.3, "threefry", False, None, [8, 128])),
    "indrnn": (torch.ops.torch_pallas.indrnn.default,
               lambda: (sequence(6, 3, 130, requires_grad=True), xla(torch.rand(130)).requires_grad_(),
                        sequence(3, 130, requires_grad=True), None, "tanh")),
    "indrnn_with_lengths": (torch.ops.torch_pallas.indrnn.default,
                            lambda: (sequence(6, 3, 130, requires_grad=True), xla(torch.rand(130)).requires_grad_(),
                                     sequence(3, 130, requires_grad=True), xla(torch.tensor([6, 0, 2], dtype=torch.int32)),
                                     "relu")),
    "indrnn_backward": (torch.ops.torch_pallas.indrnn_backward.default,
                        lambda: (sequence(6, 3, 130), sequence(3, 130), sequence(6, 3, 130).tanh(),
                                 xla(torch.rand(130)), sequence(3, 130), None, "tanh")),
}


@pytest.mark.parametrize("name", list(CASES))
def test_opcheck(name):
    op, make_args = CASES[name]
    torch.library.opcheck(op, make_args(), test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))

