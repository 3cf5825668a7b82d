"""The TorchTPU front end keeps the contract bridge.FrontEnd states; which generation its kernels
are lowered for; what a process without the tpu device is told."""

import subprocess
import sys

import pytest
import torch
from torch._subclasses import FakeTensorMode

import torch_pallas
from front_end_contract import check_a_broken_front_end_is_refused, check_front_ends_keep_the_contract
from torch_pallas import bridge
from torch_pallas.frontends import torchtpu
from torchtpu_support import DispatchedOps, torch_pallas_ops


def test_the_torchtpu_and_cpu_front_ends_keep_the_contract():
    assert bridge.STACK == "torchtpu"
    check_front_ends_keep_the_contract({"torchtpu": (bridge.FrontEnd,), "dlpack": (bridge.FrontEnd,)})


def test_a_front_end_that_breaks_the_contract_is_refused_naming_each_problem():
    check_a_broken_front_end_is_refused()


def test_kernels_are_lowered_for_the_default_generation_or_the_one_the_environment_names(monkeypatch):
    assert not torchtpu.platform_is_tpu()  # this host: TorchTPU counts no TPU
    monkeypatch.delenv(torchtpu.GENERATION_VARIABLE, raising=False)
    torchtpu._generation.cache_clear()
    assert torchtpu._generation() == torchtpu.DEFAULT_GENERATION == "v6e"
    monkeypatch.setenv(torchtpu.GENERATION_VARIABLE, "v5e")
    torchtpu._generation.cache_clear()
    assert torchtpu._generation() == "v5e"
    monkeypatch.setenv(torchtpu.GENERATION_VARIABLE, "v9z")
    torchtpu._generation.cache_clear()
    with pytest.raises(ValueError, match="generation must be one of .*'tpu7x'.*got 'v9z'"):
        torchtpu._generation()
    monkeypatch.undo()
    torchtpu._generation.cache_clear()


def test_jax_is_kept_on_its_cpu_backend():
    """JAX only traces and exports on this stack; on a TPU VM its TPU backend must not claim
    the chips TorchTPU's runtime owns."""
    import jax

    assert {device.platform for device in jax.devices()} == {"cpu"}


def test_tpu_tensors_without_seed_draw_their_key_from_the_tpu_generator(fake):
    from torchtpu_support import DispatchedOps

    x = torch.ones(8, 128, device="tpu")
    with DispatchedOps() as dispatched:
        key = torch_pallas.seeds.key_data(device="tpu")
    assert key.device.type == "tpu" and key.dtype == torch.int32 and key.shape == (2,)
    assert dispatched.names == ["aten::randint"]
    assert torch_pallas.seeds.key_data().device.type == "tpu"  # the stack's default device
    assert x.device.type == "tpu"


def test_a_process_where_torchtpu_registered_no_device_is_told_how():
    """Without a TPU TorchTPU registers no ``tpu`` device: a call needing the stack's default
    device says so (run apart: this suite's process has registered it)."""
    script = ("import torch_pallas\n"
              "try:\n    torch_pallas.seeds.key_data(seed=1)\n"
              "except RuntimeError as error:\n    print(error)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert "TorchTPU has not registered its 'tpu' device" in result.stdout, result.stdout + result.stderr[-2000:]


@pytest.fixture
def two_rank_mesh():
    """A one-process fake two-rank group (torch's test backend), for DTensors without a TPU."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield lambda device: torch.distributed.tensor.DeviceMesh(device, [0, 1])
    finally:
        dist.destroy_process_group()


def test_a_dtensor_of_tpu_tensors_runs_the_kernel_on_its_shard(two_rank_mesh):
    """docs/sharding.md, DTensors: on fake tpu tensors and a fake two-rank group, dropout of a
    DTensor (called, routed, in a converted module) dispatches torch_pallas's kernel on the rank's
    shard with the whole tensor's shape and keeps the placement; so does routed SDPA split over
    heads; SDPA split along the sequence stays torch's; indrnn names how to place its weight."""
    from torch.distributed.tensor import Shard, distribute_tensor

    tpu_mesh = two_rank_mesh("tpu")  # outside fake mode: the mesh reads its own ranks
    with FakeTensorMode():
        x = distribute_tensor(torch.randn(8, 128, device="tpu"), tpu_mesh, [Shard(0)])
        heads = distribute_tensor(torch.randn(2, 4, 128, 64, device="tpu"), tpu_mesh, [Shard(1)])
        with DispatchedOps(record_args=True) as dispatched:
            outputs = [torch_pallas.dropout(x, 0.5, seed=1, impl="threefry"),
                       torch_pallas.convert_dropout(torch.nn.Dropout(0.5))(x)]
            with torch_pallas.route_dropout():
                outputs.append(torch.nn.functional.dropout(x, 0.5))
                attended = torch.nn.functional.scaled_dot_product_attention(heads, heads, heads, dropout_p=0.5)
                with pytest.warns(UserWarning, match="dropout_p is applied by torch"):
                    along_sequence = torch.nn.functional.scaled_dot_product_attention(x[None], x[None], x[None],
                                                                                        dropout_p=0.5)
        with pytest.raises(ValueError, match=r"weight must be a DTensor of shape \(128,\) on x's mesh placed "
                                             r"\[Replicate\(\)\].*distribute_tensor"):
            torch_pallas.indrnn(x[None], torch.ones(128, device="tpu"))
    kernels = [args for name, args in dispatched.calls if name == "torch_pallas::dropout"]
    # Each op gets the rank's rows, threefry and the default, tiled (whose kernel layer draws the one band of
    # (8, 128) tiles the shard is half of, then keeps the shard's rows).
    assert [tuple(args[0].shape) for args in kernels] == [(4, 128), (4, 128), (4, 128)]
    assert all(args[0].device.type == "tpu" and list(args[8]) == [8, 128] for args in kernels)  # global_shape
    for output in outputs:
        assert type(output).__name__ == "DTensor" and output.placements == (Shard(0),) and output.shape == (8, 128)
    flash = [args for name, args in dispatched.calls if name == "torch_pallas::attention"]
    assert len(flash) == 1 and tuple(flash[0][0].shape) == (2, 2, 128, 64) and list(flash[0][14]) == [2, 4]
    assert attended.placements == (Shard(1),) and attended.shape == (2, 4, 128, 64)
    assert type(along_sequence).__name__ == "DTensor"
