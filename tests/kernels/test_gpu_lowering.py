"""What Pallas's GPU (Triton) backend makes of the kernels, by ``jax.export`` for CUDA on any
machine: docs/tensors.md, Devices, says which kernels lower there. Lowering only: no
kernel has been compiled or run on a GPU."""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax import export

from torch_pallas.kernels import compat, dropout, indrnn, sampling

# jax 0.7.1's pallas_call keeps compiler params per backend and lowers for GPU without the
# kernels' TPU ones; jax 0.10's takes one backend's params, and with TPU ones refuses both
# Triton and Mosaic GPU. Lowering for GPU there needs the kernels to pass none off TPU.
pytestmark = pytest.mark.xfail(compat.JAX_VERSION >= (0, 8), raises=ValueError, strict=True,
                               reason="jax 0.10: the kernels' TPU compiler params stop GPU lowering")

KEY = jax.ShapeDtypeStruct((2,), jnp.int32)
SEQUENCE, WEIGHT, STATE = (jax.ShapeDtypeStruct(shape, jnp.float32) for shape in ((16, 8, 128), (128,), (8, 128)))


def export_for_cuda(function, *args):
    # Pallas GPU kernels are Triton custom calls, which jax.export does not promise to keep
    # stable across versions: allowed here, where nothing is serialised.
    return export.export(jax.jit(functools.partial(function, interpret=False)), platforms=["cuda"],
                         disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)


def test_noise_kernels_lower_to_triton():
    for dtype, impl in ((jnp.float32, "threefry"), (jnp.bfloat16, "threefry"), (jnp.float32, "tiled")):
        module = export_for_cuda(functools.partial(dropout.dropout, p=0.5, impl=impl),
                                 KEY, jax.ShapeDtypeStruct((64, 256), dtype)).mlir_module()
        assert "xla.gpu.triton" in module
    module = export_for_cuda(functools.partial(sampling.sample, shape=(64, 256), distribution="normal",
                                               dtype="float32", p=0.5, impl="threefry"), KEY).mlir_module()
    assert "xla.gpu.triton" in module


def test_indrnn_kernels_do_not_lower_to_triton():
    with pytest.raises(NotImplementedError, match="scratch memory"):
        export_for_cuda(functools.partial(indrnn.indrnn_forward, nonlinearity="relu"), SEQUENCE, WEIGHT, STATE)
