"""torch's test/nn/test_dropout.py properties (tests/dropout_parity.py) on the torchax stack:
torchax tensors (device ``jax``) and CPU tensors, inside torchax's environment, for
torch_pallas's modules, functions, convert_dropout and route_dropout."""

import numpy as np
import pytest

from dropout_parity import Kind, cpu_kind
from dropout_parity import *  # noqa: F401,F403  (the test_* cases)
from torchax_support import in_env, numpy  # noqa: F401  (in_env: fixture)

pytestmark = pytest.mark.usefixtures("in_env")

# JAX without x64 has no float64: a float64 torchax tensor is float32.
KINDS = {"jax": Kind("jax", lambda t: t.to("jax"), lambda t: np.asarray(numpy(t), dtype=np.float64),
                     layouts=False, float64=False),
         "cpu": cpu_kind()}


@pytest.fixture(params=list(KINDS))
def kind(request):
    return KINDS[request.param]
