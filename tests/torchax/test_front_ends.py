"""The front ends of the torchax stack keep the contract bridge.FrontEnd states, and a call
that needs torchax's environment outside it says how to enter it."""

import pytest
import torch
import torchax

import torch_pallas
from front_end_contract import check_a_broken_front_end_is_refused, check_front_ends_keep_the_contract
from torch_pallas import bridge

_ENTER = r"inside `with torchax.default_env\(\):` or call torchax.enable_globally\(\)"


def test_the_torchax_and_cpu_front_ends_keep_the_contract():
    check_front_ends_keep_the_contract({"torchax": (bridge.FrontEnd, bridge.ShardingFrontEnd),
                                        "dlpack": (bridge.FrontEnd,)})


def test_a_front_end_that_breaks_the_contract_is_refused_naming_each_problem():
    check_a_broken_front_end_is_refused()


def test_calls_on_the_jax_device_outside_torchax_environment_name_how_to_enter_it():
    with torchax.default_env():
        x = torch.ones(8, 128, device="jax")
    with pytest.raises(RuntimeError, match=_ENTER):
        torch_pallas.random.uniform((5, 300), seed=9, device="jax")
    with pytest.raises(RuntimeError, match=_ENTER):
        torch_pallas.random.uniform((5, 300), seed=9)  # the stack's default device is jax
    with pytest.raises(RuntimeError, match=_ENTER):
        torch_pallas.dropout(x, 0.5, seed=1)
    with pytest.raises(RuntimeError, match=_ENTER):
        torch_pallas.seeds.key_data(seed=1)
    assert torch_pallas.dropout(torch.ones(8, 128), 0.5, seed=1).device.type == "cpu"  # CPU tensors need no environment
    with torchax.default_env():
        assert torch_pallas.random.uniform((5, 300), seed=9).device.type == "jax"
        with torchax.default_env():  # a nested environment's exit leaves the outer one usable
            pass
        assert torch_pallas.dropout(x, 0.5, seed=1).shape == x.shape
