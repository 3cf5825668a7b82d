"""What tests/torchtpu shares. TorchTPU without a TPU: its ``tpu`` device registered lazily
(TorchTPU registers it at ``import torch`` only where it finds a TPU; importing this module
registers it), tensors on it fake (a real allocation aborts the process: "No jellyfish device
found")."""

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

if torch._C._get_privateuse1_backend_name() != "tpu":
    from torch_tpu import _loader

    _loader._init_device("tpu")


class DispatchedOps(TorchDispatchMode):
    """Records the name of every op dispatched beneath it (``torch_pallas::dropout``,
    ``aten::randint``...)."""

    def __init__(self, record_args: bool = False):
        super().__init__()
        self.names = []
        self.calls = []  # (name, positional arguments), with record_args
        self._record_args = record_args

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func._schema.name)
        if self._record_args:
            self.calls.append((func._schema.name, args))
        return func(*args, **(kwargs or {}))


class CapturedGraphs(list):
    """A ``torch.compile`` backend that keeps each graph dynamo captures and runs it as captured
    (TorchTPU's own backend needs a TPU)."""

    def __call__(self, graph_module, example_inputs):
        self.append(graph_module)
        return graph_module


def graph_targets(graph_module) -> collections.Counter:
    """How often each function ``graph_module`` calls is called (``"torch_pallas.dropout.default"``...)."""
    return collections.Counter(str(node.target) for node in graph_module.graph.nodes if node.op == "call_function")


class CompiledBackward:
    """Runs torch's autograd over ``tpu`` tensors (``loss.backward()``, ``torch.autograd.grad``)
    through compiled autograd inside it: each backward pass is traced into an FX graph, which
    then runs. The engine's own execution crashes on ``tpu`` tensors without a TPU (SIGSEGV in
    ``GraphTask::exec_post_processing``: it indexes the per-device streams it stashed for
    TorchTPU's device count, which is 0 without one); compiled autograd returns before that.
    ``graphs`` holds the graphs traced (compiled autograd reuses a graph for the same autograd
    graph: those of earlier contexts too), ``names``/``args_of`` what ran (a dispatch mode only
    while a graph runs: dynamo compiles nothing under one)."""

    _active = None  # the context graphs report to, wherever they were compiled

    def __init__(self):
        self.graphs = []
        self._dispatched = DispatchedOps(record_args=True)

    def _compiler(self, graph_module):
        self.graphs.append(graph_module)

        def run(*args, **kwargs):
            with CompiledBackward._active._dispatched:
                return graph_module(*args, **kwargs)

        return run

    def __enter__(self):
        from torch._dynamo import compiled_autograd

        self._enabled = compiled_autograd._enable(self._compiler)
        self._enabled.__enter__()
        CompiledBackward._active = self
        return self

    def __exit__(self, *exc):
        CompiledBackward._active = None
        self._enabled.__exit__(*exc)

    @property
    def names(self):
        return self._dispatched.names

    def args_of(self, op_name):
        """The positional arguments of each call of ``op_name`` that ran."""
        return [args for name, args in self._dispatched.calls if name == op_name]


class _Context:
    """What an autograd formula's ``setup_context`` and ``backward`` use of ``ctx``, without
    the autograd engine (which crashes on ``tpu`` tensors without a TPU:
    ``GraphTask::exec_post_processing``)."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def save_for_forward(self, *tensors):
        pass


def run_formula(setup_context, backward, inputs, output, *grad_outputs):
    """``backward``'s gradients for ``grad_outputs`` (one per output), ``ctx`` set up from the
    forward's ``inputs`` and ``output`` as torch's autograd would."""
    ctx = _Context()
    setup_context(ctx, inputs, output)
    return backward(ctx, *grad_outputs)


# Ops of torch's own noise or attention that a torch_pallas call must leave none of.
_TORCH_NOISE = ("aten::dropout", "aten::native_dropout", "aten::feature_dropout", "aten::bernoulli",
                "aten::scaled_dot_product", "aten::_scaled_dot_product")


def torch_pallas_ops(names):
    """Those of the dispatched op ``names`` that are torch_pallas's, in order."""
    return [name for name in names if name.startswith("torch_pallas")]


def torch_noise_ops(names):
    """Those of the dispatched op ``names`` that are torch's dropout, bernoulli or SDPA."""
    return [name for name in names if name.startswith(_TORCH_NOISE)]


def check_on_tpu(tensor, shape, dtype):
    """``tensor`` is a fake ``tpu`` tensor of ``shape`` and ``dtype``."""
    assert (tuple(tensor.shape), tensor.dtype, tensor.device.type) == (tuple(shape), dtype, "tpu"), tensor
    assert type(tensor).__name__ == "FakeTensor"


def check_formula_dispatches(setup_context, backward, inputs, output, grad_outputs, op_name):
    """Runs the formula (:func:`run_formula`) and checks that ``op_name`` is the one torch_pallas
    op it dispatched, once; returns (the gradients, the arguments ``op_name`` got)."""
    with DispatchedOps(record_args=True) as dispatched:
        grads = run_formula(setup_context, backward, inputs, output, *grad_outputs)
    ours = [(name, args) for name, args in dispatched.calls if name.startswith("torch_pallas")]
    assert [name for name, _ in ours] == [op_name], dispatched.names
    return grads, ours[0][1]


def check_dispatches(call, op_name, count=1):
    """Runs ``call()``, checks it dispatched ``op_name`` ``count`` times and none of torch's
    noise or attention ops; returns what ``call`` returned."""
    with DispatchedOps() as dispatched:
        result = call()
    assert dispatched.names.count(op_name) == count, dispatched.names
    assert not torch_noise_ops(dispatched.names), dispatched.names
    return result


def check_kernel_op(compute, args, kernel_name, shapes_and_dtypes):
    """Runs an op's computation (what a real ``tpu`` tensor runs; under fake mode torch runs the
    op's fake function instead) and checks it applied one custom op TorchTPU's ``jax_op`` made of
    ``kernel_name`` and returned a fake ``tpu`` tensor per (shape, dtype)."""
    with DispatchedOps() as dispatched:
        outputs = compute(*args)
    kernels = [name for name in dispatched.names if name.startswith("torch_pallas_tpu::")]
    assert len(kernels) == 1 and kernels[0].startswith(f"torch_pallas_tpu::{kernel_name}_"), dispatched.names
    outputs = (outputs,) if isinstance(outputs, torch.Tensor) else outputs
    assert len(outputs) == len(shapes_and_dtypes)
    for output, (shape, dtype) in zip(outputs, shapes_and_dtypes):
        check_on_tpu(output, shape, dtype)
    return outputs
