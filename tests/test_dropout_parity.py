"""torch's test/nn/test_dropout.py properties (tests/dropout_parity.py) on the xla stack: XLA
tensors and CPU tensors, for torch_pallas's modules, functions, convert_dropout and
route_dropout."""

import pytest
import torch_xla

from dropout_parity import Kind, cpu_kind
from dropout_parity import *  # noqa: F401,F403  (the test_* cases)

KINDS = {"xla": Kind("xla", lambda t: t.to(torch_xla.device()), lambda t: t.detach().cpu().double().numpy(),
                     layouts=False),
         "cpu": cpu_kind()}


@pytest.fixture(params=list(KINDS))
def kind(request):
    return KINDS[request.param]
