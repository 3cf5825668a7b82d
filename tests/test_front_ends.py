"""The front ends of the torch_xla stack keep the contract bridge.FrontEnd states."""

from front_end_contract import check_a_broken_front_end_is_refused, check_front_ends_keep_the_contract
from torch_pallas import bridge


def test_the_xla_and_cpu_front_ends_keep_the_contract():
    check_front_ends_keep_the_contract({
        "xla": (bridge.FrontEnd, bridge.ShardingFrontEnd, bridge.GraphCompilingFrontEnd),
        "dlpack": (bridge.FrontEnd,)})


def test_a_front_end_that_breaks_the_contract_is_refused_naming_each_problem():
    check_a_broken_front_end_is_refused()
