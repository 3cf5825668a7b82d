"""The README's torchax tour is code a new user pastes: it must run as written."""

import re
from pathlib import Path

import numpy as np
import torch
import torchax

import torch_pallas

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_torchax_tour_runs():
    blocks = [block for block in re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
              if "torchax.default_env()" in block]
    assert blocks, "the README has no torchax snippet"
    namespace = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
    with torchax.default_env():
        x = namespace["x"]
        assert x.grad is not None and namespace["y"].shape == x.shape
        on_cpu = torch_pallas.dropout(x.detach().cpu(), 0.1, seed=7)
        np.testing.assert_array_equal(namespace["y7"].detach().numpy(), on_cpu.numpy())
        assert np.isfinite(namespace["loss"].numpy())
