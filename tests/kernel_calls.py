"""Records the kernel calls a test's code makes, through the bridge every kernel passes."""

from torch_pallas import bridge
from torch_pallas.kernels import dropout as dropout_kernels


def record_dropout_keys(monkeypatch) -> list:
    """Key data of every dropout kernel call from now on (forward, recomputation and
    backward; autograd runs the backward on another thread, so no dispatch mode sees it)."""
    keys, call = [], bridge.call

    def recording_call(jax_function, *tensors, **static):
        if jax_function is dropout_kernels.dropout:
            keys.append(tuple(tensors[0].cpu().tolist()))
        return call(jax_function, *tensors, **static)

    monkeypatch.setattr(bridge, "call", recording_call)
    return keys
