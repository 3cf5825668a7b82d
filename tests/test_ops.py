"""torch.library.opcheck over every custom op, on XLA tensors: schema, fake (meta) function,
and AOT dispatch (which, for inputs that require grad, also compares the registered
backward's gradients with eager mode's).

opcheck's autograd-registration check is left out: in torch 2.9 it runs only on CPU, CUDA
and XPU tensors ("NYI devices other than CPU/CUDA/XPU"), and these ops need XLA tensors."""

import pytest
import torch
import torch_xla

import torch_pallas
import torch_pallas.ops.dropout  # noqa: F401  (registers the ops)
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



# ops/_autograd: which form a call takes.

def _eager_calls():
    """(name, output, the leaves it was computed from) of each differentiable op's public call."""
    x = sequence(6, 3, 128, requires_grad=True)
    weight = xla(torch.rand(128)).requires_grad_()
    query = sequence(1, 2, 8, 16, requires_grad=True)
    return [
        ("dropout", torch_pallas.dropout(x, 0.3, seed=1), (x,)),
        ("dropout_add", torch_pallas.dropout_add(x, x.detach() + 1, 0.3, seed=1), (x,)),
        ("indrnn", torch_pallas.indrnn(x, weight)[0], (x, weight)),
        ("attention", torch_pallas.scaled_dot_product_attention(query, query, query, dropout_p=0.3, seed=1),
         (query,)),
    ]


def test_an_eager_call_crosses_one_autograd_layer_and_no_custom_op(monkeypatch):
    """In eager mode the output's grad_fn is the op's one plain Function, straight above the
    leaves (no custom op's generated Function below it), and no custom op is dispatched,
    forward or backward."""
    from torch._library.custom_ops import CustomOpDef

    seen, call = [], CustomOpDef.__call__

    def recording_call(self, *args, **kwargs):
        seen.append(self._qualname)
        return call(self, *args, **kwargs)

    monkeypatch.setattr(CustomOpDef, "__call__", recording_call)
    calls = _eager_calls()
    for _, output, _ in calls:
        output.sum().backward(retain_graph=True)
    assert seen == []
    for name, output, _ in calls:
        grad_fn = output.grad_fn
        assert type(grad_fn).__name__.endswith("_eagerBackward"), (name, grad_fn)
        below = {type(fn).__name__ for fn, _ in grad_fn.next_functions if fn is not None}
        assert below == {"AccumulateGrad"}, (name, below)


def test_dropout_is_twice_differentiable_in_eager_mode():
    """Its backward is dropout again (linear in x): with create_graph it goes through the
    eager Function once more, and the second derivative of sum(dropout(x) ** 2) is
    2 * scale ** 2 where kept."""
    x = sequence(8, 128, requires_grad=True)
    y = torch_pallas.dropout(x, 0.5, seed=3)
    (grad,) = torch.autograd.grad((y ** 2).sum(), x, create_graph=True)
    (second,) = torch.autograd.grad(grad.sum(), x)
    kept = (y != 0).cpu()
    torch.testing.assert_close(second.cpu(), torch.where(kept, 8.0, 0.0), rtol=0, atol=0)


def test_fake_tensors_go_through_the_op():
    """Tensors torch traces (fake, functional) take the custom op, whose fake function answers."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(4, 128, device=torch_xla.device())
        key_data = torch.empty(2, dtype=torch.int32, device=torch_xla.device())
        y = torch_pallas.ops.dropout.apply(x, key_data, p=0.5, impl="threefry")
    assert isinstance(y, FakeTensor) and y.shape == (4, 128)
