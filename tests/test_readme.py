"""The python blocks of the README and of the docs pages are code a new user pastes: they must
run as written. A document's blocks run in order in one namespace, on the stack it is written
for: a document that imports torchax (the torchax tour) in tests/torchax/test_readme.py, a block
on TorchTPU's ``tpu`` device in tests/torchtpu/test_readme.py, a block
that enters SPMD mode (``use_spmd()``, process-wide) in tests/spmd/, the rest here."""

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCUMENTS = (README, *sorted((ROOT / "docs").rglob("*.md")))


def python_blocks(documents=DOCUMENTS) -> list[str]:
    return [block for document in documents
            for block in re.findall(r"```python\n(.*?)```", document.read_text(), flags=re.S)]


def blocks_on(document: Path, stack: str) -> list[str]:
    """``document``'s blocks that run on ``stack``: "xla", "torchax", "torchtpu" (a block that
    puts tensors on the ``tpu`` device) or "spmd"."""
    blocks = python_blocks([document])
    imports_torchax = any(re.search(r"^(import .*\btorchax\b|from torchax)", block, re.M) for block in blocks)
    own = "torchax" if imports_torchax else "xla"

    def stack_of(block):
        if "use_spmd()" in block:
            return "spmd"
        return "torchtpu" if re.search(r"""device\(?=?["']tpu["']""", block) else own

    return [block for block in blocks if stack_of(block) == stack]


def documents_with_blocks(stack: str) -> list[Path]:
    return [document for document in DOCUMENTS if blocks_on(document, stack)]


def run_blocks(document: Path, stack: str) -> dict:
    namespace = {}
    for block in blocks_on(document, stack):
        exec(compile(block, str(document), "exec"), namespace)
    return namespace


def check_readme(namespace):
    import torch_pallas

    x = namespace["x"]
    assert x.grad is not None
    torch.testing.assert_close(namespace["y7"].cpu(), torch_pallas.dropout(x.detach().cpu(), 0.1, seed=7),
                               rtol=0, atol=0)


def check_tour(namespace):
    import torch_pallas

    assert namespace["output"].shape == (100, 8, 512) and namespace["h_n"].shape == (4, 8, 256)
    assert namespace["packed_h_n"].shape == (4, 3, 256)
    assert namespace["b"].dtype == torch.bool and namespace["z"].dtype == torch.bfloat16
    assert torch.equal(namespace["y_cpu"], torch_pallas.dropout(namespace["x"].detach(), 0.1, seed=7).cpu())


def check_changelog(namespace):
    """Its one line gives every op threefry's masks again; the test's process gets its default back."""
    import torch_pallas

    try:
        assert torch_pallas.random.get_default_impl("dropout") == "threefry"
        x = torch.ones(8, 128)
        assert torch.equal(torch_pallas.dropout(x, 0.5, seed=1), torch_pallas.dropout(x, 0.5, seed=1, impl="threefry"))
    finally:
        torch_pallas.random.set_default_impl(None)
    assert torch_pallas.random.get_default_impl("dropout") == "tiled"


CHECKS = {README: check_readme, ROOT / "docs" / "tour-xla.md": check_tour,
          ROOT / "docs" / "changelog.md": check_changelog}


def test_the_readme_and_the_tours_show_code():
    assert python_blocks([README]), "the README has no python snippet"
    assert set(CHECKS) <= set(documents_with_blocks("xla"))


@pytest.mark.parametrize("document", documents_with_blocks("xla"), ids=lambda path: str(path.relative_to(ROOT)))
def test_snippets_run(document):
    namespace = run_blocks(document, "xla")
    CHECKS.get(document, lambda namespace: None)(namespace)
