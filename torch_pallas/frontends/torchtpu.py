"""The TorchTPU front end: tensors on TorchTPU's ``tpu`` device (torch_tpu, torch 2.11-2.15).

The only module of torch_pallas that imports torch_tpu (torch itself may import it first:
torch_tpu is a device backend torch loads at ``import torch``, and it registers the ``tpu``
device only where it finds a TPU). A kernel reaches TorchTPU's graphs as a custom op that
TorchTPU's ``jax_op`` makes from the JAX function with its static configuration bound, one op
per function and configuration: its fake function exports the function for TPU
(``jax.export``, Mosaic custom calls kept), and on a TPU its implementation hands that export
to libtpu through TorchTPU's runtime. JAX only traces and exports here, never runs: it is kept
on its CPU backend (:func:`_keep_jax_off_the_tpu`), and Pallas lowers the kernels for a
compile-only TPU device of the generation TorchTPU's device has (:func:`_generation`), so JAX
never claims the TPU TorchTPU owns. Kernels are lowered for TPU (Mosaic), never interpreted.

DTensors of ``tpu`` tensors run their local shards through this front end as plain tensors
(:mod:`torch_pallas.dtensors`); nothing of this module has run on a TPU.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import os
import warnings

import jax
import torch

from torch_pallas import bridge, tpu_compile
from torch_pallas.frontends.dlpack import check_use_reentrant, checkpoint  # noqa: F401  (torch's own)
from torch_pallas.kernels import compat

IMPLEMENTS = (bridge.FrontEnd,)
DEVICE_DESCRIPTION = "a TorchTPU device ('tpu')"
MOVE_HINT = "'tpu'"
GENERATOR_DEVICE_TYPES = ("cpu", "tpu")
GENERATORS = "a CPU or TorchTPU ('tpu') torch.Generator"
SEEDED_BY = "torch.manual_seed"
CHECKPOINT_FUNCTIONS = ()

DEVICE_TYPE = "tpu"
# The TPU generation kernels are lowered for where no TPU says (a key of
# tpu_compile.GENERATIONS); TORCH_PALLAS_TPU_GENERATION names another.
GENERATION_VARIABLE = "TORCH_PALLAS_TPU_GENERATION"
DEFAULT_GENERATION = "v6e"
# The namespace of the custom ops jax_op makes from the kernels.
OP_NAMESPACE = "torch_pallas_tpu"


def _keep_jax_off_the_tpu() -> None:
    """JAX only traces and exports for TorchTPU; on a TPU VM its TPU backend would try to own
    the chips TorchTPU's runtime holds. An explicit ``JAX_PLATFORMS`` wins; the compile-only
    TPU devices the kernels are lowered for work either way."""
    from jax._src import xla_bridge

    if not os.environ.get("JAX_PLATFORMS") and not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")


_keep_jax_off_the_tpu()


def _tpu_count() -> int:
    """TPU chips this host has, as TorchTPU's loader counts them (0 here: no runtime started)."""
    from torch_tpu._internal.utils import hardware

    return hardware.get_tpu_device_count()


def platform_is_tpu() -> bool:
    """Whether this host has a TPU (TorchTPU then registered its device at ``import torch``)."""
    return _tpu_count() > 0


@functools.cache
def _generation() -> str:
    """The TPU generation kernels are lowered for: ``$TORCH_PALLAS_TPU_GENERATION`` if set, else
    that of TorchTPU's device on a TPU, else :data:`DEFAULT_GENERATION`.

    Raises:
        ValueError: the variable names a generation the installed libtpu does not know, or the
            TPU's kind is none of them.
    """
    named = os.environ.get(GENERATION_VARIABLE)
    if named:
        tpu_compile.tpu_device(named)  # checks the name
        return named
    if not platform_is_tpu():
        return DEFAULT_GENERATION
    from torch_tpu._internal.device import _device_ops_backend

    kind = _device_ops_backend._get_local_device_attributes().get("device_kind")
    for name in tpu_compile.GENERATIONS:
        if tpu_compile.tpu_device(name).device_kind == kind:
            return name
    raise ValueError(f"TorchTPU's device is a {kind!r}, which the installed libtpu compiles for under none of "
                     f"{', '.join(tpu_compile.GENERATIONS)}: set {GENERATION_VARIABLE} to the nearest")


def _device_registered() -> bool:
    return torch._C._get_privateuse1_backend_name() == DEVICE_TYPE


def default_device() -> torch.device:
    check_device_usable(None)
    return torch.device(DEVICE_TYPE)


def check_device_usable(device) -> None:
    """TorchTPU registers its ``tpu`` device only where it finds a TPU."""
    if not _device_registered():
        raise RuntimeError("TorchTPU has not registered its 'tpu' device (it does so only on a host with a TPU; "
                           "torch_tpu._loader._init_device('tpu') registers it without one, for fake tensors)")


def runs_lazily(tensor: torch.Tensor) -> bool:
    """TorchTPU's eager modes run each op when it is called (its fused eager mode batches ops,
    but every op's result is computed)."""
    return False


def draw_key_words(device: torch.device) -> torch.Tensor:
    """Two int32 words from the ``tpu`` device's default generator, which ``torch.manual_seed``
    seeds (TorchTPU's ``manual_seed_all``; a no-op without a TPU)."""
    return bridge.torch_key_words(device)


# (function, static items, number of inputs) -> the custom op jax_op made of it.
_OPS: dict = {}
_op_numbers = itertools.count()


def _op_for(jax_function, static: tuple, tensors):
    """The custom op applying ``jax_function`` with ``static`` bound, made by TorchTPU's
    ``jax_op`` the first time: its schema takes the tensors only (a new static value is a
    new op, as it is a new lowering on the other stacks), and returns what ``jax_function``
    returns for ``tensors``' shapes (one array, or a fixed-length tuple of them)."""
    key = (jax_function, static, len(tensors))
    op = _OPS.get(key)
    if op is None:
        from torch_tpu._internal.pallas.pallas import jax_op

        bound = functools.partial(jax_function, **dict(static), interpret=False)
        arguments = [jax.ShapeDtypeStruct(tuple(t.shape), jax.numpy.dtype(str(t.dtype).removeprefix("torch.")))
                     for t in tensors]
        outputs = jax.eval_shape(bound, *arguments)
        returns = jax.Array if isinstance(outputs, jax.ShapeDtypeStruct) else tuple[(jax.Array,) * len(outputs)]

        def kernel(*arrays):
            return bound(*arrays)

        # jax_op reads the schema from the signature: one array per tensor.
        kernel.__signature__ = inspect.Signature(
            [inspect.Parameter(f"input{i}", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=jax.Array)
             for i in range(len(tensors))], return_annotation=returns)
        name = f"{OP_NAMESPACE}::{jax_function.__name__}_{next(_op_numbers)}"
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*jax_op is experimental")
            op = _OPS[key] = jax_op(name, kernel)
    return op


def _kernel_op(jax_function, tensors, static: dict):
    """The custom op :func:`call` applies (for tests and tools: its fake function exports the
    kernel TorchTPU runs)."""
    return _op_for(jax_function, tuple(sorted(static.items())), tensors)


def _lowering_context():
    """The context in which kernels are exported for :func:`_generation`'s TPU."""
    return compat.lowering_for_device(tpu_compile.tpu_device(_generation()))


def call(jax_function, tensors, static: dict):
    """``jax_function(*tensors, **static)`` as TorchTPU's custom op of it (:func:`_kernel_op`),
    exported for TPU under :func:`_lowering_context`."""
    op = _kernel_op(jax_function, tensors, static)
    with _lowering_context():
        outputs = op(*tensors)
    return outputs if isinstance(outputs, torch.Tensor) else tuple(outputs)


def register_op(op, compute, formula) -> None:
    """``tpu`` tensors reach a custom op through torch's dispatcher, which knows it already."""


def defer_function_to_mode(func, mode_type) -> None:
    """TorchTPU takes no torch function before torch's mode stack does."""
