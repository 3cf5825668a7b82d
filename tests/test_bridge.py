"""The bridge: the interpret decision, device checks, and a JAX function on XLA tensors."""

import os

import jax
import pytest
import torch
import torch_xla

from torch_pallas import bridge

from conftest import ON_TPU


def test_interpret_mode_follows_the_device():
    assert bridge.interpret_mode() is (not ON_TPU)
    assert bridge.default_noise_impl() == "threefry"  # on TPU too: bench/results/tpu_cost.md


def test_non_xla_tensor_error_names_the_fix():
    with pytest.raises(ValueError, match=r"x\.to\(torch_xla\.device\(\)\)"):
        bridge.check_on_xla(torch.ones(2), "x")


def _double(x, *, scale, interpret):
    del interpret
    return x * scale


def test_call_runs_a_jax_function_on_xla_tensors():
    x = torch.arange(6, dtype=torch.float32, device=torch_xla.device())
    y = bridge.call(_double, x, scale=2.0)
    assert y.device.type == "xla"
    torch.testing.assert_close(y.cpu(), torch.arange(6, dtype=torch.float32) * 2)


@pytest.mark.skipif(ON_TPU or bool(os.environ.get("JAX_PLATFORMS")), reason="JAX picks its platforms itself there")
def test_jax_uses_only_its_cpu_backend_beside_the_cpu_client():
    # With libtpu installed (the test extra), JAX would otherwise try to start a TPU
    # backend and print libtpu's initialisation errors in every CPU run.
    assert jax.config.jax_platforms == "cpu"
    assert {device.platform for device in jax.devices()} == {"cpu"}
