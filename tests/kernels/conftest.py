"""Kernel tests call JAX directly, on the JAX CPU backend in interpret mode, whatever the
PJRT device of the torch tests is; TPU compilation is checked with libtpu's compile-only
client (test_tpu_compile.py)."""

import jax
import pytest

from reference import emulated_hardware_tile_bits
from torch_pallas.kernels import prng


@pytest.fixture(autouse=True)
def _jax_on_cpu():
    with jax.default_device(jax.devices("cpu")[0]):
        yield


@pytest.fixture
def emulated_hardware_prng(monkeypatch):
    """``impl="hardware"`` runs in interpret mode with :func:`emulated_hardware_tile_bits`: which
    tile of the whole tensor each element's bits come from is then checked on CPU."""
    monkeypatch.setattr(prng, "hardware_tile_bits", emulated_hardware_tile_bits)
    monkeypatch.setattr(prng, "check_can_run", lambda impl, interpret: prng.check_impl(impl))
