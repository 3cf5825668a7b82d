"""What differs between the JAX versions the kernels run on (jax 0.7.1, torch_xla 2.9's pin,
and the newest, 0.10.2), in one place: the kernels themselves are the same code on both.

- Mosaic IR version: jax 0.7.1 serialises Mosaic kernels in IR version 8, which libtpu 0.0.21
  (the one torch_xla 2.9 pins) rejects ("Unsupported version: expected <= 7 but got 8",
  pytorch/xla issue 9614): :func:`pin_mosaic_ir_version` makes it write 7. jax 0.10 picks
  the version from the TPU runtime's build date itself, and libtpu 0.0.52 compiles what it
  picks: nothing to pin there.
- TPU generation at lowering time: jax 0.10's Pallas TPU lowering reads the generation (and
  its vreg shape) from the default device, so lowering for a TPU on a machine without one
  needs that TPU's device as the default (:func:`lowering_for_device`). jax 0.7.1 does not
  ask; setting it there is harmless.
- ``pltpu.repeat`` (a Mosaic primitive in jax 0.7.1) is gone in jax 0.10, where Pallas TPU
  lowers ``jnp.tile`` to the same copies of whole vregs: :func:`repeat`.
- A kernel's ``name=``: jax 0.8.1 and later put the ``pallas_call`` in a scope of that name,
  so its custom call's ``op_name`` (what HLO dumps and TPU profiles show) carries it; jax 0.7.1
  puts it only on the StableHLO custom call, which drops it on the way to HLO:
  :func:`kernel_scope`.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

JAX_VERSION = tuple(int(part) for part in jax.__version__.split(".")[:3])

# jax before 0.8 writes IR version 8 unless its build-date rule (cut-off 2025-08-14) finds
# the runtime older; libtpu 0.0.21 was built a day after it and accepts up to 7.
_NEEDS_IR_VERSION_PIN = JAX_VERSION < (0, 8, 0)
# jax commit 0f26969 (November 2025, first released in 0.8.1) wraps pallas_call's bind in
# named_scope(name).
_PALLAS_CALL_NAMES_ITS_SCOPE = JAX_VERSION >= (0, 8, 1)
# Whether elementwise kernels draw a tiled-impl tile in pieces of 8 rows of its hash grid (the same
# bits either way). On libtpu's static schedule of dropout at 2**22 elements, jax 0.7.1's libtpu
# 0.0.21 schedules the pieces shorter (v4 24-26%, v6e 12-13%, v5e and v5p 11% in bfloat16, 3% longer
# in float32 where HBM bounds them), jax 0.10's libtpu 0.0.52 the whole tile (pieces 4-14% longer on
# v5e-v6e, the same on v4): bench/results/tpu_cost.md, The tiled impl.
TILED_HASH_IN_PIECES = JAX_VERSION < (0, 8, 0)


def pin_mosaic_ir_version() -> bool:
    """Where the JAX version needs it, makes Mosaic kernels lowered for TPU use the IR version
    the TPU runtime paired with that JAX accepts; returns whether it pinned.

    jax 0.7.1's rule picks version 7 when lowering is forward-compatible, which JAX forces for
    the platforms in ``FORCE_FORWARD_COMPAT_LOWERING_PLATFORMS``. Process-wide, applied on
    every platform, so kernels compiled for TPU on a machine without one lower exactly as on a
    TPU. Idempotent.
    """
    if not _NEEDS_IR_VERSION_PIN:
        return False
    from jax._src import xla_bridge

    xla_bridge.FORCE_FORWARD_COMPAT_LOWERING_PLATFORMS.add("tpu")
    return True


def mosaic_ir_version_pinned() -> bool:
    """Whether :func:`pin_mosaic_ir_version` is in effect."""
    from jax._src import xla_bridge

    # jax 0.10 has no such set (it forces forward compatibility per runtime instead).
    return "tpu" in getattr(xla_bridge, "FORCE_FORWARD_COMPAT_LOWERING_PLATFORMS", ())


@contextlib.contextmanager
def unpinned_mosaic_ir_version():
    """Inside, no pin: Mosaic kernels get the IR version JAX picks by itself."""
    from jax._src import xla_bridge

    pinned = mosaic_ir_version_pinned()
    if pinned:
        xla_bridge.FORCE_FORWARD_COMPAT_LOWERING_PLATFORMS.discard("tpu")
    try:
        yield
    finally:
        if pinned:
            xla_bridge.FORCE_FORWARD_COMPAT_LOWERING_PLATFORMS.add("tpu")


def lowering_for_device(device):
    """A context in which Pallas lowers kernels for ``device``'s TPU generation (a compile-only
    device included) whatever the default device was."""
    return jax.default_device(device)


def repeat(x, repeats: int, axis: int):
    """``x`` repeated ``repeats`` times along ``axis`` (whole copies, as ``jnp.tile``), inside
    a TPU kernel."""
    if hasattr(pltpu, "repeat"):
        return pltpu.repeat(x, repeats, axis=axis)
    return jnp.tile(x, [repeats if dim == axis % x.ndim else 1 for dim in range(x.ndim)])


def kernel_scope(name: str):
    """A context in which a ``pallas_call`` named ``name`` gets the name scope jax 0.8.1 and
    later give it themselves (op_name ``.../NAME/pallas_call``); on those, nothing."""
    return contextlib.nullcontext() if _PALLAS_CALL_NAMES_ITS_SCOPE else jax.named_scope(name)
