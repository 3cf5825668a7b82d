"""The README's tour is code a new user pastes: it must run as written."""

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_tour_runs():
    blocks = python_blocks()
    assert blocks, "the README has no python snippet"
    namespace = {}
    for block in blocks:
        if "use_spmd()" in block:
            continue  # SPMD mode is process-wide: tests/spmd/ runs this block
        if "torchax.default_env()" in block:
            continue  # the torchax stack's: tests/torchax/test_readme.py
        exec(compile(block, str(README), "exec"), namespace)
    assert namespace["output"].shape == (100, 8, 512) and namespace["h_n"].shape == (4, 8, 256)
    assert namespace["packed_h_n"].shape == (4, 3, 256)
    assert namespace["b"].dtype == torch.bool and namespace["z"].dtype == torch.bfloat16
    import torch_pallas

    assert torch.equal(namespace["y_cpu"], torch_pallas.dropout(namespace["x"].detach(), 0.1, seed=7).cpu())
