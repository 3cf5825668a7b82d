"""route_dropout with torch's checkpoints, torch.compile and torch.fx on CPU tensors, on the TorchTPU
stack (tests/routing_cases.py)."""

from routing_cases import *  # noqa: F401,F403  (the test_* cases)
