"""Argument checks of the public torch functions; each raises before any kernel runs.

The rules shared with the kernels (choices, probabilities) live in
:mod:`torch_pallas.kernels.arguments`, so every layer raises the same message.
"""

from __future__ import annotations

import numbers
import warnings

import torch

from torch_pallas import bridge, seeds
from torch_pallas.kernels import prng
from torch_pallas.kernels.arguments import check_probability  # noqa: F401  (re-exported)

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# torch's dropout takes float64 too; its mask comes from the float32 kernel (ops/dropout.py).
DROPOUT_DTYPES = FLOAT_DTYPES + (torch.float64,)


class TorchRuntimeError(RuntimeError, ValueError):
    """Bad input that torch rejects with a ``RuntimeError`` (its message is torch's): both that
    (code written against torch's exception catches ours) and a ``ValueError`` (the project's
    type for bad input)."""


def check_shape(shape, name: str = "shape") -> tuple[int, ...]:
    """An int or a sequence of non-negative ints (torch.Size included), as a tuple."""
    if isinstance(shape, numbers.Integral) and not isinstance(shape, bool):
        shape = (shape,)
    if not isinstance(shape, (tuple, list, torch.Size)):
        raise TypeError(f"{name} must be a sequence of ints, got {type(shape).__name__}")
    for size in shape:
        if isinstance(size, bool) or not isinstance(size, numbers.Integral):
            raise TypeError(f"{name} must contain only ints, got {size!r} in {tuple(shape)}")
        if size < 0:
            raise ValueError(f"{name} must not contain negative sizes, got {tuple(shape)}")
    return tuple(int(size) for size in shape)


def check_float_dtype(dtype, name: str = "dtype") -> torch.dtype:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype, got {type(dtype).__name__}")
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be one of torch.float32, torch.bfloat16, torch.float16, got {dtype}")
    return dtype


def check_tensor(tensor, name: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    return tensor


# The kinds of random op, each with its default impl (torch_pallas.random.get_default_impl).
DROPOUT = "dropout"
SAMPLING = "sampling"
_DEFAULT_IMPLS = {DROPOUT: prng.DROPOUT_DEFAULT, SAMPLING: prng.SAMPLING_DEFAULT}
KINDS = tuple(_DEFAULT_IMPLS)


def noise_arguments(p, impl, seed, generator, p_name: str = "p", kind: str = DROPOUT) -> tuple[float, str]:
    """The checked ``p`` and resolved ``impl`` of a noise function's call of ``kind``, after
    checking where its key would come from (``seed``, ``generator``:
    :func:`torch_pallas.seeds.check_source`), whether or not one is drawn."""
    p = check_probability(p, p_name)
    impl = resolve_impl(impl, kind)
    seeds.check_source(seed, generator)
    return p, impl


def check_float_tensor(tensor, name: str, dtypes=FLOAT_DTYPES, *, dtensors: bool = False) -> torch.Tensor:
    """A tensor of one of ``dtypes`` on a device torch_pallas runs on (an XLA device, torchax's
    ``jax`` device or the CPU), or TypeError/ValueError naming ``name``; a DTensor only where
    the op takes them (``dtensors``)."""
    check_tensor(tensor, name)
    if tensor.dtype not in dtypes:
        names = ", ".join(str(dtype).removeprefix("torch.") for dtype in dtypes[:-1])
        raise TypeError(f"{name} must be {names} or {str(dtypes[-1]).removeprefix('torch.')}, got {tensor.dtype}")
    bridge.check_device(tensor, name, dtensors=dtensors)
    return tensor


def resolve_impl(impl, kind: str = DROPOUT) -> str:
    """``impl``, or the default of ``kind``'s ops (:func:`torch_pallas.random.get_default_impl`);
    ``"hardware"`` only on TPU."""
    if impl is not None:
        return _check_impl(impl, "impl")
    chosen = bridge.chosen_noise_impl()
    if chosen is None:
        return _DEFAULT_IMPLS[kind]
    # Set by the environment or set_default_impl: name where it came from if it is refused.
    return _check_impl(chosen, f"the default noise impl (torch_pallas.random.set_default_impl or "
                               f"${bridge.NOISE_IMPL_VARIABLE})")


def _check_impl(impl, name: str) -> str:
    prng.check_impl(impl, name)
    # Lowered for TPU (a graph built to be compiled by libtpu, never run here) the hardware
    # PRNG is what the TPU would run.
    if impl == prng.HARDWARE and not bridge.lowers_for_tpu():
        raise ValueError(
            f"{name} is 'hardware', which uses the TPU's hardware PRNG and needs PJRT_DEVICE=TPU; "
            "use impl='threefry' or impl='tiled' here")
    return impl


def jax_dtype_name(dtype: torch.dtype) -> str:
    """The JAX/numpy name of a torch dtype, as static configuration for a kernel."""
    return str(dtype).removeprefix("torch.")


def check_lengths(lengths, device: torch.device, steps: int, batch: int) -> torch.Tensor:
    """Per-sequence lengths as the kernels take them: int32 ``(B,)`` on ``device``, values in
    ``[0, steps]`` (checked where they are on the CPU; on an XLA device a check would sync)."""
    if not isinstance(lengths, torch.Tensor):
        try:
            lengths = torch.tensor(lengths)
        except (TypeError, ValueError, RuntimeError) as error:
            raise TypeError(f"lengths must be a tensor or a list of ints, got {type(lengths).__name__}") from error
    if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
        raise TypeError(f"lengths must hold integers, got {lengths.dtype}")
    if lengths.shape != (batch,):
        raise ValueError(f"lengths must have shape ({batch},), one per sequence, got {tuple(lengths.shape)}")
    if lengths.device.type == "cpu" and batch and not (0 <= int(lengths.min()) and int(lengths.max()) <= steps):
        raise ValueError(f"lengths must be in [0, {steps}] (the padded length), got {lengths.tolist()}")
    return lengths.to(device=device, dtype=torch.int32)


@torch.compiler.assume_constant_result
def warn(message: str, stacklevel: int) -> bool:
    """``warnings.warn(message)`` (a UserWarning) on behalf of the public function's caller, in
    a form ``torch.compile`` accepts: dynamo cannot trace ``warnings.warn`` (the graph breaks,
    and under ``route_dropout`` compiled transformers crashed), so it runs this function once
    while tracing, outside the graph, and keeps its constant result. In eager mode Python's
    default filter shows it once per call site. ``stacklevel`` counts as ``warnings.warn``'s
    does from the function calling this one."""
    warnings.warn(message, UserWarning, stacklevel=stacklevel + 1)
    return True
