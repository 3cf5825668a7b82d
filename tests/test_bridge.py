"""The bridge: the interpret decision, device checks, and a JAX function on XLA tensors."""

import os

import jax
import pytest
import torch
import torch_xla

from torch_pallas import bridge

from conftest import ON_TPU, on_a_device_without_front_end


def test_interpret_mode_follows_the_device():
    assert bridge.interpret_mode() is (not ON_TPU)


def test_devices_torch_pallas_runs_on_and_the_error_for_others_names_the_fix():
    assert bridge.runs_on(torch_xla.device()) and bridge.runs_on(torch.device("cpu"))
    assert not bridge.runs_on(torch.device("cuda"))
    bridge.check_device(torch.ones(2), "x")
    bridge.check_device(torch.ones(2, device="meta"), "x")  # shapes only, as torch's ops (routing_cases)
    with pytest.raises(ValueError, match=r"x is on cuda:0.*x\.to\(torch_xla\.device\(\)\)"):
        bridge.check_device(on_a_device_without_front_end(2), "x")


def _double(x, *, scale, interpret):
    del interpret
    return x * scale


@pytest.mark.parametrize("device", ["xla", "cpu"])
def test_call_runs_a_jax_function_on_the_tensors_device(device):
    x = torch.arange(6, dtype=torch.float32, device=torch_xla.device() if device == "xla" else device)
    y = bridge.call(_double, x, scale=2.0)
    assert y.device.type == device
    torch.testing.assert_close(y.cpu(), torch.arange(6, dtype=torch.float32) * 2)


def test_cpu_call_takes_tensors_that_require_grad_or_are_not_contiguous():
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4).requires_grad_()
    y = bridge.call(_double, x.t(), scale=3.0)
    assert torch.equal(y, x.detach().t() * 3) and not y.requires_grad


@pytest.mark.skipif(ON_TPU or bool(os.environ.get("JAX_PLATFORMS")), reason="JAX picks its platforms itself there")
def test_a_dtensor_handed_to_a_kernel_call_is_refused():
    """A kernel takes a rank's local tensor; a DTensor reaching a front end crashed the process
    (sample_tokens' seeds as a DTensor, before they were read whole)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DeviceMesh, DTensor, Replicate
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        x = DTensor.from_local(torch.ones(4), DeviceMesh("cpu", [0, 1]), [Replicate()], run_check=False)
        with pytest.raises(TypeError, match="argument 1 of _double is a DTensor.*to_local"):
            bridge.call(_double, torch.ones(4), x, scale=2.0)
    finally:
        dist.destroy_process_group()


def test_jax_uses_only_its_cpu_backend_beside_the_cpu_client():
    # With libtpu installed (the test extra), JAX would otherwise try to start a TPU
    # backend and print libtpu's initialisation errors in every CPU run.
    assert jax.config.jax_platforms == "cpu"
    assert {device.platform for device in jax.devices()} == {"cpu"}
