"""torch tensors in, a JAX function applied, torch tensors out.

The only module that touches torch_xla's JAX interop or hands torch tensors to JAX. On XLA
tensors a kernel becomes one node of the lazy XLA graph: lowered by JAX once per function,
static configuration and input shapes, then applied with one torch_xla call (what
``call_jax`` does, without its per-call work); tensors on a device JAX also has (the CPU) go
to JAX through DLPack and the same kernels run there. It decides, from the device, whether
Pallas kernels run compiled (TPU) or in interpret mode (any other device), and which noise
generator is the default there.

Under :func:`lowering_for_tpu` (or ``TORCH_PALLAS_LOWER_FOR_TPU=1``) the kernels enter the
lazy graph as TPU (Mosaic) custom calls on any PJRT device, so that the graph of a whole
training step can be compiled for a TPU on a machine without one
(:func:`torch_pallas.tpu_compile.compile_graph`); such a graph cannot run there.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import torch_xla
import torch_xla.runtime as xr
from torch_xla._internal.jax_workarounds import jax_import_guard

# On TPU, torch_xla's PJRT client must own the chips before JAX initialises, or XLA
# operations hang; this module is imported before anything that imports JAX.
jax_import_guard()

import torch_xla.core.xla_builder as xb  # noqa: E402  (after the guard)
from jax._src import config as _jax_config  # noqa: E402
from jax._src import xla_bridge as _jax_xla_bridge  # noqa: E402


def _pin_mosaic_ir_version() -> None:
    """Makes jax 0.7.1 serialise Mosaic kernels in IR version 7, which the libtpu that
    torch_xla 2.9 pins (0.0.21) accepts; it rejects version 8 ("Unsupported version:
    expected <= 7 but got 8", pytorch/xla issue 9614).

    jax picks 8 unless a build-date rule (``jax/_src/tpu_custom_call.py:get_ir_version``)
    finds the TPU runtime older than 2025-08-14, and libtpu 0.0.21 was built on 2025-08-15.
    The rule also picks 7 when lowering is forward-compatible, which JAX forces for the
    platforms in this set. Applied on every platform, so the TPU-compile tests on CPU
    lower exactly as a TPU run does.
    """
    _jax_xla_bridge.FORCE_FORWARD_COMPAT_LOWERING_PLATFORMS.add("tpu")


_pin_mosaic_ir_version()


def _keep_jax_on_cpu_with_the_cpu_client() -> None:
    """On ``PJRT_DEVICE=CPU`` JAX needs only its CPU backend. Without this, an installed
    libtpu (the test extra's TPU compiler) makes JAX try to start a TPU backend at its
    first use and print libtpu's initialisation errors. An explicit ``JAX_PLATFORMS`` wins;
    libtpu's compile-only TPU devices (:mod:`torch_pallas.tpu_compile`) work either way."""
    if xr.device_type() == "CPU" and not os.environ.get("JAX_PLATFORMS"):
        import jax

        jax.config.update("jax_platforms", "cpu")


_keep_jax_on_cpu_with_the_cpu_client()


# Both facts are fixed for a process; dynamo treats them as constants instead of tracing
# into torch_xla's C++ bindings (which it cannot).
@torch.compiler.assume_constant_result
@functools.cache  # every kernel call asks; torch_xla reads the environment each time
def on_tpu() -> bool:
    """Whether the XLA device is a TPU (``PJRT_DEVICE=TPU``)."""
    return xr.device_type() == "TPU"


@torch.compiler.assume_constant_result
def _default_xla_device() -> torch.device:
    return torch_xla.device()


def interpret_mode() -> bool:
    """Whether kernels on XLA tensors run in Pallas's interpret mode: on every PJRT device but
    a TPU, unless they are lowered for TPU (:func:`lowers_for_tpu`)."""
    return not lowers_for_tpu()


# The process-wide noise impl of calls without ``impl=``, as JAX's ``jax_default_prng_impl``:
# read from the environment once, changed by torch_pallas.random.set_default_impl.
NOISE_IMPL_VARIABLE = "TORCH_PALLAS_NOISE_IMPL"
# "threefry" on every platform, TPU included: it is bit for bit jax.random on every backend and
# tested so here, while the hardware PRNG's bits, though libtpu's schedule makes it the fast
# impl there (bench/results/tpu_cost.md), have never run on a TPU; it is opt-in until they have.
PLATFORM_NOISE_IMPL = "threefry"
_default_noise_impl = os.environ.get(NOISE_IMPL_VARIABLE) or PLATFORM_NOISE_IMPL


def default_noise_impl() -> str:
    """The noise impl of calls without ``impl=`` (unchecked: the environment may name any):
    the last :func:`set_default_noise_impl`, else ``$TORCH_PALLAS_NOISE_IMPL``, else
    :data:`PLATFORM_NOISE_IMPL`."""
    return _default_noise_impl


def set_default_noise_impl(impl: str | None) -> None:
    """Makes ``impl`` (checked by the caller) the default; ``None`` restores the environment's
    or the platform's. Dynamo guards on the value read: a change recompiles."""
    global _default_noise_impl
    _default_noise_impl = impl or os.environ.get(NOISE_IMPL_VARIABLE) or PLATFORM_NOISE_IMPL


# Devices whose tensors go to JAX through DLPack: torch's device type -> JAX's platform.
# torch_xla pins JAX to its CPU backend on PJRT_DEVICE=CPU (see above), so other platforms
# (a CUDA jaxlib's "gpu") would need JAX set up for them; only the CPU is tested.
_JAX_PLATFORMS = {"cpu": "cpu", "cuda": "gpu"}


_jax_platform_found: dict[str, bool] = {}


@torch.compiler.assume_constant_result  # fixed for a process; dynamo cannot trace into JAX
def _jax_has_platform(platform: str) -> bool:
    if platform not in _jax_platform_found:
        import jax

        try:
            _jax_platform_found[platform] = bool(jax.devices(platform))
        except RuntimeError:
            _jax_platform_found[platform] = False
    return _jax_platform_found[platform]


def runs_on(device: torch.device) -> bool:
    """Whether torch_pallas's ops run on tensors of ``device``: an XLA device, or a device
    JAX has a backend for (the CPU)."""
    if device.type == "xla":
        return True
    platform = _JAX_PLATFORMS.get(device.type)
    return platform is not None and _jax_has_platform(platform)


def device_or_default(device=None) -> torch.device:
    """The device to create tensors on: ``device`` if given (checked by :func:`runs_on`),
    else the default XLA device.

    Raises:
        ValueError: torch_pallas cannot run on ``device``.
    """
    if device is None:
        return _default_xla_device()
    device = torch.device(device)
    if not runs_on(device):
        raise ValueError(f"device must be an XLA device (torch_xla.device()) or the CPU, got {device}")
    return device


def check_device(tensor: torch.Tensor, name: str) -> None:
    """Raises ValueError unless torch_pallas runs on ``tensor``'s device (:func:`runs_on`),
    naming the fix."""
    if not runs_on(tensor.device):
        raise ValueError(
            f"{name} is on {tensor.device}, but torch_pallas ops run on XLA devices and the CPU: "
            f"move it with {name}.to(torch_xla.device())")


def call(jax_function, *tensors: torch.Tensor, **static):
    """Applies ``jax_function(*tensors, interpret=..., **static)`` on the tensors' device.

    XLA tensors: as one node of the lazy XLA graph (:func:`_call_in_graph`). Other tensors (all on one
    device that :func:`runs_on` accepts): through DLPack to JAX on the same device, where
    the function runs jitted in interpret mode, and back. ``jax_function`` must be defined at
    module level: both paths cache its traced graph by the function, the tensors' shapes and
    dtypes, and the ``static`` values (each new static value traces and compiles anew, so
    pass only hashable configuration there).
    """
    if tensors[0].device.type != "xla":
        return _call_through_dlpack(jax_function, tensors, static)
    return _call_in_graph(jax_function, tensors, static)


LOWER_FOR_TPU_VARIABLE = "TORCH_PALLAS_LOWER_FOR_TPU"


def _lowering_for_tpu_in(environment) -> bool:
    """Whether ``environment`` turns TPU lowering on: ``TORCH_PALLAS_LOWER_FOR_TPU`` set to
    anything but ``""`` or ``"0"``."""
    return environment.get(LOWER_FOR_TPU_VARIABLE, "0") not in ("", "0")


# Process-wide, not per thread: autograd runs the backward pass on a thread of its own, and
# its kernels must be lowered as the forward's are.
_lowering_for_tpu = _lowering_for_tpu_in(os.environ)


def lowers_for_tpu() -> bool:
    """Whether XLA tensors' kernels enter the lazy graph as TPU custom calls (always on TPU;
    elsewhere under :func:`lowering_for_tpu` or ``TORCH_PALLAS_LOWER_FOR_TPU=1``)."""
    return on_tpu() or _lowering_for_tpu


@contextlib.contextmanager
def lowering_for_tpu(enabled: bool = True):
    """Inside this context, kernels applied to XLA tensors are lowered for TPU (Pallas
    compiled to Mosaic, not interpret mode) on every PJRT device, so the lazy graph holds
    the same TPU custom calls as on a TPU. Off by default; ``TORCH_PALLAS_LOWER_FOR_TPU=1``
    in the environment turns it on for the whole process.

    On ``PJRT_DEVICE=CPU`` such a graph is for :func:`torch_pallas.tpu_compile.compile_graph`
    only: the CPU client cannot run a TPU custom call, so fetching or syncing a tensor that
    depends on one fails. Process-wide while active (the backward pass runs on another
    thread). Tensors on the CPU (not XLA) still run in interpret mode.

    Example::

        >>> with torch_pallas.tpu_compile.lowering_for_tpu():
        ...     loss = model(x).loss
        ...     loss.backward()
        >>> torch_pallas.tpu_compile.compile_graph([loss, *grads], "v5e").peak_bytes
    """
    global _lowering_for_tpu
    previous, _lowering_for_tpu = _lowering_for_tpu, enabled
    try:
        yield
    finally:
        _lowering_for_tpu = previous


# (function, interpret (the platform), static values in the caller's order, JAX's trace
# context, input shapes and dtypes) -> the lowered computation and whether it returns one
# array (else a tuple of them). call_jax keeps such a cache too, but reaches it
# through pytree flattening and sixteen environment-variable contexts on every call; here a
# call after the first is a dictionary lookup and one torch_xla call.
_COMPUTATIONS: dict = {}


def _call_in_graph(jax_function, tensors, static: dict):
    """``jax_function(*tensors, **static)`` as one node of the lazy XLA graph: lowered once per
    key (for TPU when :func:`lowers_for_tpu`, else for JAX's backend beside the client, the
    CPU) and applied with torch_xla's ``_xla_user_computation``, the call ``call_jax`` ends in
    (torch_xla 2.9's C++ binding, kept by the pin; ``call_jax`` uses it the same way)."""
    interpret = not lowers_for_tpu()
    key = (jax_function, interpret, *static.items(), _jax_config.trace_context(),
           *[(tensor.shape, tensor.dtype) for tensor in tensors])
    lowered = _COMPUTATIONS.get(key)
    if lowered is None:
        lowered = _COMPUTATIONS[key] = _lower(jax_function, tensors, dict(static, interpret=interpret),
                                              None if interpret else "tpu")
    computation, single = lowered
    outputs = torch_xla._XLAC._xla_user_computation("xla::torch_pallas", list(tensors), computation)
    return outputs[0] if single else tuple(outputs)


def _lower(jax_function, tensors, static: dict, platform):
    """The XLA computation of ``jax_function`` for ``tensors``' shapes and dtypes, and whether
    it returns one array (else a tuple or list of them)."""
    import jax
    import jax.numpy as jnp
    from torch_xla._internal.jax_workarounds import jax_env_context

    trees = []

    def flat(*arrays):
        leaves, tree = jax.tree.flatten(jax_function(*arrays, **static))
        trees.append(tree)
        return leaves

    arguments = [jax.ShapeDtypeStruct(tuple(tensor.shape), jnp.dtype(str(tensor.dtype).removeprefix("torch.")))
                 for tensor in tensors]
    with jax_env_context():  # what call_jax sets around JAX on torch_xla's clients
        traced = jax.jit(flat, keep_unused=True).trace(*arguments)
        lowered = traced.lower(lowering_platforms=(platform,)) if platform else traced.lower()
        proto = lowered.compiler_ir("hlo").as_serialized_hlo_module_proto()
    return xb.computation_from_module_proto("torch_pallas", proto), trees[0].num_nodes == 1


@functools.cache
def _jitted(jax_function, static: tuple):
    import jax

    # Interpret mode: Mosaic kernels run only on TPUs, and these kernels use TPU memory
    # spaces that Pallas's GPU lowering does not have.
    return jax.jit(functools.partial(jax_function, **dict(static), interpret=True))


# torch's CPU allocator aligns every buffer to 64 bytes, as jaxlib wants a buffer it shares.
_DLPACK_ALIGNMENT = 64


def _shareable(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a buffer JAX can share: detached (DLPack exports no tensor that requires
    grad; autograd is above this layer), contiguous, and aligned (a view at an offset, such
    as one sample's key under vmap, is copied here rather than by jaxlib, which logs it)."""
    tensor = tensor.detach().contiguous()
    return tensor.clone() if tensor.data_ptr() % _DLPACK_ALIGNMENT else tensor


def _call_through_dlpack(jax_function, tensors, static):
    import jax

    arrays = [jax.dlpack.from_dlpack(_shareable(tensor)) for tensor in tensors]
    outputs = _jitted(jax_function, tuple(sorted(static.items())))(*arrays)
    return jax.tree.map(torch.from_dlpack, outputs)
