"""What tests/torchtpu shares. TorchTPU without a TPU: its ``tpu`` device registered lazily
(TorchTPU registers it at ``import torch`` only where it finds a TPU; importing this module
registers it), tensors on it fake (a real allocation aborts the process: "No jellyfish device
found")."""

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


class _Context:
    """What an autograd formula's ``setup_context`` and ``backward`` use of ``ctx``, without
    the autograd engine (which crashes on ``tpu`` tensors without a TPU:
    ``GraphTask::exec_post_processing``)."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def save_for_forward(self, *tensors):
        pass


def run_formula(setup_context, backward, inputs, output, grad_output):
    """``backward``'s gradients for ``grad_output``, ``ctx`` set up from the forward's
    ``inputs`` and ``output`` as torch's autograd would."""
    ctx = _Context()
    setup_context(ctx, inputs, output)
    return backward(ctx, grad_output)
