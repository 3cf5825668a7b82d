"""torch tensors in, a JAX function applied, torch tensors out.

The only module that touches torch_xla's JAX interop. It decides, from the PJRT device,
whether Pallas kernels run compiled (TPU) or in interpret mode (any other device), and
which noise generator is the default there.
"""

from __future__ import annotations

import os

import torch
import torch_xla
import torch_xla.runtime as xr
from torch_xla._internal.jax_workarounds import jax_import_guard

# On TPU, torch_xla's PJRT client must own the chips before JAX initialises, or XLA
# operations hang; this module is imported before anything that imports JAX.
jax_import_guard()

import torch_xla.core.xla_builder as xb  # noqa: E402  (after the guard)
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
def on_tpu() -> bool:
    """Whether the XLA device is a TPU (``PJRT_DEVICE=TPU``)."""
    return xr.device_type() == "TPU"


@torch.compiler.assume_constant_result
def _default_xla_device() -> torch.device:
    return torch_xla.device()


def interpret_mode() -> bool:
    """Pallas runs compiled on TPU and in interpret mode on every other PJRT device."""
    return not on_tpu()


def default_noise_impl() -> str:
    """``"threefry"`` on every platform.

    On TPU the hardware PRNG is opt-in (``impl="hardware"``): reseeding it per (8, 128) tile,
    as the block-invariance contract needs, compiles to a threefry hash of a whole vector
    register per tile, and libtpu's schedule for it is 2-4x longer than threefry's on
    v4/v5e/v5p/v6e (``bench/results/tpu_cost.md``). Threefry is also bit for bit
    ``jax.random`` on every backend.
    """
    return "threefry"


def xla_device(device=None) -> torch.device:
    """The XLA device to create tensors on: ``device`` if given, else the default one.

    Raises:
        ValueError: ``device`` is not an XLA device.
    """
    if device is None:
        return _default_xla_device()
    device = torch.device(device)
    if device.type != "xla":
        raise ValueError(f"device must be an XLA device (torch_xla.device()), got {device}")
    return device


def check_on_xla(tensor: torch.Tensor, name: str) -> None:
    """Raises ValueError unless ``tensor`` lives on an XLA device, naming the fix."""
    if tensor.device.type != "xla":
        raise ValueError(
            f"{name} is on {tensor.device}, but torch_pallas ops run on XLA devices: "
            f"move it with {name}.to(torch_xla.device())")


def call(jax_function, *tensors: torch.Tensor, **static):
    """Applies ``jax_function(*tensors, interpret=..., **static)`` inside the lazy XLA graph.

    ``jax_function`` must be defined at module level: call_jax caches its traced graph by
    the function's id, the tensors' shapes and dtypes, and the ``static`` values (each new
    static value traces and compiles anew, so pass only configuration there).
    """
    return xb.call_jax(jax_function, tensors, dict(static, interpret=interpret_mode()))
