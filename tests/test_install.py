"""Installing torch_pallas: the install lines of the README and docs/install.md name extras that
exist; a stack whose library is installed but does not import beside the installed torch leaves
the package working on CPU tensors, with a warning naming the fix (torch_pallas.bridge); and, in the
slow tier, each extra installed into an empty virtual environment from PyPI alone gives a working
stack (issue 71)."""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import pytest
import torch

import torch_pallas
from torch_pallas import bridge

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def install_lines(text: str) -> list[str]:
    """The ``pip install ...`` commands of a Markdown text: code spans (which may break across
    lines) and lines of code blocks."""
    return re.findall(r"pip\s+install\s[^`]*?(?=`|\n\n|$)", text)


def test_the_install_lines_of_the_readme_and_the_install_page_name_extras_that_exist():
    lines = {document: install_lines((ROOT / document).read_text()) for document in ("README.md", "docs/install.md")}
    assert all(lines.values()), f"no install line found in {[d for d, found in lines.items() if not found]}"
    named = {(document, extra) for document, found in lines.items() for line in found
             for extras in re.findall(r"\[([\w,\s-]+)\]", line) for extra in re.split(r"\s*,\s*", extras.strip())}
    assert {extra for _, extra in named} >= {"xla", "torchax", "torchtpu"}
    assert not [(document, extra) for document, extra in named if extra not in EXTRAS], \
        f"extras not in pyproject.toml (it has {sorted(EXTRAS)})"
    # What they install is this source tree: torch-pallas is not on PyPI (2026-12-01).
    assert not [line for found in lines.values() for line in found if re.search(r"torch[-_]pallas\[", line)], lines


# Run by this stack's python with a torch_xla that fails to import as torch_xla 2.9.0 does beside
# torch 2.15 (its C++ extension was built against torch 2.9.0).
_BROKEN_TORCH_XLA = (
    'raise ImportError("/venv/lib/python3.11/site-packages/_XLAC.cpython-311-x86_64-linux-gnu.so: '
    'undefined symbol: _ZN5torch8autograd12VariableInfoC1ERKN2at6TensorEb")\n')
_IMPORT_AND_RUN = """
import json, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torch
    import torch_pallas
    from torch_pallas import bridge
    y = torch_pallas.dropout(torch.ones(8, 128), 0.5, seed=1)
    default = bridge.device_or_default()
print(json.dumps({"stack": bridge.STACK, "values": sorted(set(y.flatten().tolist())), "default": str(default),
                  "xla": bridge.front_end("xla") is not None,
                  "warnings": [str(w.message) for w in caught if str(w.message).startswith("torch_pallas:")]}))
"""


def test_an_installed_torch_xla_that_does_not_import_leaves_cpu_tensors_working_and_names_the_fix(tmp_path):
    """torch_xla 2.9.0 beside another torch than 2.9.0 (what pip resolved for the xla extra before it
    pinned torch): ``import torch_pallas`` and CPU tensors work, with a warning that names the fix,
    and XLA tensors are not taken."""
    (tmp_path / "torch_xla").mkdir()
    (tmp_path / "torch_xla" / "__init__.py").write_text(_BROKEN_TORCH_XLA)
    # Without torch_xla's CPU client to keep it there, JAX would try libtpu's TPU backend first.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]), "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-c", _IMPORT_AND_RUN], capture_output=True, text=True, env=env,
                            cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["stack"] == "dlpack" and report["default"] == "cpu" and not report["xla"]
    assert report["values"] == [0.0, 2.0]
    [warning] = report["warnings"]
    assert "torch_xla" in warning and "undefined symbol" in warning, warning
    assert "torch_xla 2.9 needs torch 2.9.0: pip install torch==2.9.0 (torch_pallas's xla extra pins it)" in warning, \
        warning
    assert "CPU tensors only" in warning, warning


@pytest.mark.parametrize("stack, device_type, error", [
    ("torchax", "jax", "AttributeError(\"The underlying op of 'aten.prod' has no overload name 'dim_Dimname'\")"),
    ("torchtpu", "tpu", "ImportError('libtorch_tpu_glue.so: cannot open shared object file')"),
])
def test_an_installed_torchax_or_torch_tpu_that_does_not_import_leaves_cpu_tensors_working(
        stack, device_type, error, tmp_path, monkeypatch):
    """As for torch_xla, for the other stacks (torchax's error is what torchax 0.0.13 raises on torch
    2.13 and newer), here in this process: the bridge meets the broken library at the stack's first
    use (as torch_pallas's import does for TorchTPU), and the process runs on plain CPU tensors
    until the test ends. (A torch_tpu that fails this way at ``import torch``, which loads it as a
    device backend, stops torch itself first.)"""
    library = bridge._LIBRARIES[stack]
    (tmp_path / library).mkdir()
    (tmp_path / library / "__init__.py").write_text(f"raise {error}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, library, raising=False)
    monkeypatch.setattr(bridge, "STACK", stack)
    monkeypatch.setattr(bridge, "_STACK_DEVICE_TYPE", device_type)
    assert device_type not in bridge._loaded
    fix = re.escape(bridge._FIXES[stack])
    with pytest.warns(UserWarning, match=rf"torch_pallas: {library}.* cannot be imported .*{fix}"):
        assert bridge.default_front_end() is bridge.front_end("cpu")
    assert bridge.STACK == "dlpack" and bridge.front_end(device_type) is None
    assert bridge.device_or_default() == torch.device("cpu")
    assert set(torch_pallas.dropout(torch.ones(8, 128), 0.5, seed=1).unique().tolist()) == {0.0, 2.0}


# The slow tier: each extra from PyPI alone into an empty virtual environment.

# What the fresh environment's python runs: the stack must be the extra's (not the CPU fallback),
# with no warning from torch_pallas, and one dropout on a CPU tensor and, where this machine can
# make one, on the stack's own tensor (the same noise: the same seed gives the same mask everywhere).
_CHECK_FRESH = """
import importlib.metadata, json, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torch
    import torch_pallas
    from torch_pallas import bridge
    y = torch_pallas.dropout(torch.ones(8, 128), 0.5, seed=1)
    same = None
    if bridge.STACK == "xla":
        import torch_xla
        z = torch_pallas.dropout(torch.ones(8, 128, device=torch_xla.device()), 0.5, seed=1)
        same = torch.equal(z.cpu(), y)
    elif bridge.STACK == "torchax":
        import numpy as np, torchax
        with torchax.default_env():
            z = torch_pallas.dropout(torch.ones(8, 128, device="jax"), 0.5, seed=1)
            same = bool(np.array_equal(np.asarray(torchax.interop.jax_view(z)), y.numpy()))
versions = {}
for name in ("torch", "torch_xla", "torchax", "torch_tpu", "jax", "jaxlib", "flax", "libtpu", "numpy"):
    try:
        versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        pass
print(json.dumps({"stack": bridge.STACK, "values": sorted(set(y.flatten().tolist())), "same": same,
                  "versions": versions,
                  "warnings": [str(w.message) for w in caught if str(w.message).startswith("torch_pallas:")]}))
"""

# The versions each extra must resolve (its pins), and whether the stack's own tensors can be made
# here (tpu tensors need a TPU).
_FRESH = {
    "xla": ({"torch": r"2\.9\.0", "torch_xla": r"2\.9\.0", "jax": r"0\.7\.1", "jaxlib": r"0\.7\.1"}, True),
    "torchax": ({"torch": r"2\.12\.\d+", "torchax": r"0\.0\.(1[3-9]|[2-9]\d)"}, True),
    "torchtpu": ({"torch": r"2\.1[1-5]\.\d+", "torch_tpu": r"0\.2\.\d+"}, False),
}
# pip settings kept from this process's environment: how to reach an index, not which or what.
_PIP_KEPT = {"PIP_CERT", "PIP_CLIENT_CERT", "PIP_PROXY", "PIP_DEFAULT_TIMEOUT", "PIP_TIMEOUT", "PIP_RETRIES",
             "PIP_CACHE_DIR", "PIP_NO_CACHE_DIR", "PIP_DISABLE_PIP_VERSION_CHECK", "PIP_PROGRESS_BAR"}


def _run(command, env, timeout, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("extra", list(_FRESH))
def test_each_extra_installs_from_pypi_alone_into_an_empty_environment_and_runs(extra):
    """``pip install '<this source tree>[<extra>]'`` into a new virtual environment, with pip's
    configuration set aside (``PIP_CONFIG_FILE`` = the null device, ``PIP_CONSTRAINT`` an empty file,
    no ``PIP_*`` variable but those of :data:`_PIP_KEPT`): pypi.org alone, no constraints and no cap, so
    pip resolves what a user's empty environment gets today, whatever this machine's pip is told (this
    project's machines cap torch at 2.14.1 and add local mirrors). Then ``pip check``, the versions
    the extra pins (:data:`_FRESH`), and the stack importing and running a dropout
    (:data:`_CHECK_FRESH`), on the CPU. A few GB and 4-5 minutes per extra here (pip's cache, where
    it has one, is used); the environment is deleted after. Only the installed extra's stack is
    checked; torch_pallas itself comes from the source tree (it is not on PyPI). Unlike the rest of
    the slow tier, nothing faster covers it: the fast tests check the fallback and the docs' extras,
    not what PyPI resolves."""
    pins, stack_tensor = _FRESH[extra]
    work = Path(tempfile.mkdtemp(prefix=f"torch_pallas-fresh-{extra}-"))
    try:
        source = work / "source"  # what an sdist holds: pip builds in a copy, not in this checkout
        source.mkdir()
        for name in ("pyproject.toml", "README.md"):
            shutil.copy(ROOT / name, source)
        shutil.copytree(ROOT / "torch_pallas", source / "torch_pallas",
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        (work / "no-constraints.txt").write_text("")
        env = {name: value for name, value in os.environ.items()
               if not name.startswith("PIP_") or name in _PIP_KEPT}
        env.update(PIP_CONFIG_FILE=os.devnull, PIP_CONSTRAINT=str(work / "no-constraints.txt"))
        for name in ("PYTHONPATH", "VIRTUAL_ENV", "JAX_PLATFORMS", "XLA_FLAGS"):
            env.pop(name, None)
        venv = work / "venv"
        python = str(venv / "bin" / "python")
        created = _run([sys.executable, "-m", "venv", str(venv)], env, 300)
        assert created.returncode == 0, created.stderr
        upgraded = _run([python, "-m", "pip", "install", "--upgrade", "pip"], env, 600)
        if upgraded.returncode != 0:
            pytest.skip(f"pypi.org is not reachable with pip's configuration set aside: {upgraded.stderr[-500:]}")
        installed = _run([python, "-m", "pip", "install", f"{source}[{extra}]"], env, 3600)
        assert installed.returncode == 0, installed.stderr[-5000:]
        checked = _run([python, "-m", "pip", "check"], env, 300)
        assert checked.returncode == 0, checked.stdout
        run_env = {**env, "PJRT_DEVICE": "CPU"}
        if extra == "torchtpu":
            # torch loads torch_tpu at import: without these libtpu waits minutes for cloud metadata.
            run_env.update(TPU_SKIP_MDS_QUERY="1", TPU_WORKER_HOSTNAMES="localhost", JAX_PLATFORMS="cpu")
        ran = _run([python, "-c", _CHECK_FRESH], run_env, 900, cwd=work)
        assert ran.returncode == 0, ran.stderr[-5000:]
        report = json.loads(ran.stdout.splitlines()[-1])
        print(f"[{extra}] {report}")
        assert report["stack"] == extra and not report["warnings"], report
        assert all(re.fullmatch(pin, report["versions"].get(name, "")) for name, pin in pins.items()), \
            (pins, report["versions"])
        assert report["values"] == [0.0, 2.0]
        assert report["same"] is (True if stack_tensor else None), report
    finally:
        shutil.rmtree(work, ignore_errors=True)
