"""The torchax stack's python blocks of the README and the docs pages (the torchax tour) run as
written: a new user pastes them (the other stacks' blocks: tests/test_readme.py)."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torchax

import torch_pallas

# tests/test_readme.py finds and classifies the blocks; it is a file of the xla stack's tests,
# which this stack does not collect, so it is loaded by path.
_spec = importlib.util.spec_from_file_location("readme_snippets", Path(__file__).parents[1] / "test_readme.py")
snippets = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(snippets)
TOUR = snippets.ROOT / "docs" / "tour-torchax.md"


def check_tour(namespace):
    with torchax.default_env():
        x = namespace["x"]
        assert x.grad is not None and namespace["y"].shape == x.shape
        on_cpu = torch_pallas.dropout(x.detach().cpu(), 0.1, seed=7)
        np.testing.assert_array_equal(namespace["y7"].detach().numpy(), on_cpu.numpy())
        assert np.isfinite(namespace["loss"].numpy())


def test_the_torchax_tour_shows_code():
    assert TOUR in snippets.documents_with_blocks("torchax")


@pytest.mark.parametrize("document", snippets.documents_with_blocks("torchax"),
                         ids=lambda path: str(path.relative_to(snippets.ROOT)))
def test_snippets_run(document):
    namespace = snippets.run_blocks(document, "torchax")
    if document == TOUR:
        check_tour(namespace)
