"""The front-end contract (:class:`torch_pallas.bridge.FrontEnd` and its optional parts),
checked on every front end a stack loads: tests/test_front_ends.py (xla and dlpack) and
tests/torchax/test_front_ends.py (torchax and dlpack) call these."""

import inspect
import types

import pytest

from torch_pallas import bridge

def front_ends_of_this_stack() -> dict:
    """Every front end this stack loads, by the name of its module."""
    return {name: bridge.front_end(device_type) for device_type, name in bridge.FRONT_ENDS.items()
            if name in ("dlpack", bridge.STACK)}


def check_front_ends_keep_the_contract(expected: dict) -> None:
    """Each front end implements what ``expected`` (module name -> protocols) says, passes
    :func:`bridge.check_front_end`, and has no public function that no protocol names (a
    misspelt member would be one)."""
    loaded = front_ends_of_this_stack()
    assert set(loaded) == set(expected)
    members = {name for protocol in bridge.PROTOCOLS for name in bridge.members_of(protocol)}
    for name, module in loaded.items():
        assert set(module.IMPLEMENTS) == set(expected[name]), name
        bridge.check_front_end(module)
        own_functions = {function_name for function_name, value in vars(module).items()
                         if inspect.isfunction(value) and not function_name.startswith("_")
                         and value.__module__ == module.__name__}
        assert own_functions <= members, f"{name}: {own_functions - members} are in no protocol"


def check_a_broken_front_end_is_refused() -> None:
    """A module that misses a member, or takes other parameters, is named with each problem."""
    dlpack = bridge.front_end("cpu")
    broken = types.ModuleType("broken_front_end")
    broken.__dict__.update({name: getattr(dlpack, name) for name in bridge.members_of(bridge.FrontEnd)})
    broken.IMPLEMENTS = (bridge.FrontEnd, bridge.ShardingFrontEnd)
    del broken.draw_key_words
    broken.call = lambda jax_function, tensors: None
    with pytest.raises(TypeError) as raised:
        bridge.check_front_end(broken)
    message = str(raised.value)
    assert "broken_front_end" in message and "draw_key_words (FrontEnd) is missing" in message
    assert "call must take (jax_function, tensors: 'Sequence[torch.Tensor]', static: 'dict')" in message
    assert "sharding_of (ShardingFrontEnd) is missing" in message
    assert message.count("draw_key_words") == 1  # FrontEnd's members are checked once, not once per protocol
    broken.IMPLEMENTS = ()
    with pytest.raises(TypeError, match="IMPLEMENTS does not name bridge.FrontEnd"):
        bridge.check_front_end(broken)
