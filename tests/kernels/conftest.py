"""Kernel tests call JAX directly, on the JAX CPU backend in interpret mode, whatever the
PJRT device of the torch tests is; TPU compilation is checked with libtpu's compile-only
client (test_tpu_compile.py)."""

import jax
import pytest


@pytest.fixture(autouse=True)
def _jax_on_cpu():
    with jax.default_device(jax.devices("cpu")[0]):
        yield
