"""The documentation site builds with ``mkdocs build --strict`` (what ``./dev docs`` runs): a broken
link or anchor, a docstring reference to a torch_pallas name the API reference lacks, or an
``Args:`` row naming no parameter fails it. Run once, on this stack (the build reads the source
and imports nothing of the package)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_site_builds_strict(tmp_path):
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    # the docs packages come with the test extra (pyproject.toml), pinned like the rest
    assert result.returncode == 0, result.stderr[-5000:]
    assert (tmp_path / "api" / "torch_pallas" / "index.html").exists()


def test_api_reference_lists_every_public_name():
    import torch_pallas

    pages = "".join(path.read_text() for path in (ROOT / "docs" / "api").glob("*.md"))
    modules = {name for name in torch_pallas.__all__ if isinstance(getattr(torch_pallas, name), type(torch_pallas))}
    missing = [name for name in torch_pallas.__all__
               if f"::: torch_pallas.{name}" not in pages and f"- {name}\n" not in pages]
    assert not missing, f"not in docs/api/: {missing}"
    assert all(f"::: torch_pallas.{name}\n" in pages for name in modules)


def test_benchmark_pages_include_every_committed_result():
    pages = "".join(path.read_text() for path in (ROOT / "docs" / "benchmarks").glob("*.md"))
    results = sorted((ROOT / "bench" / "results").glob("*.md")) + sorted((ROOT / "bench" / "results").glob("*.png"))
    missing = [path.name for path in results if f"bench/results/{path.name}" not in pages]
    assert not missing, f"bench/results files no page of docs/benchmarks/ shows: {missing}"
