"""transformers' and PEFT's own tests, run as those projects run them, three times: plain, with
``torch_pallas.route_dropout()`` around each test, and with the models' dropout modules converted
as well (tests/thirdparty_plugin.py says how); no test that passes plain may fail or error in the
other two (issue 71). Slow tier: each case takes minutes to hours per run.

The test files must match the installed library, so they come from the registry at the installed
version: ``pip download NAME==VERSION --no-binary :all: --no-deps``, whose ``tests/`` is unpacked
into ``~/.cache/torch_pallas/thirdparty/NAME-VERSION`` (or ``$TORCH_PALLAS_THIRDPARTY_CACHE``)
and kept there, the tarball deleted. PEFT's sdist has its test files (less ``tests/__init__.py``,
an empty file that is added, and ``conftest.py``, whose only hooks are for the regression suite
and macOS); ``TORCH_PALLAS_PEFT_SOURCE`` overrides the download.

transformers' sdist has only ``tests/*_common.py``, not ``tests/models`` nor ``tests/generation``,
and no other registry route brings them. Its ``tests/test_modeling_common.py`` holds the model
tests themselves (``ModelTesterMixin``: training, gradient checkpointing in both modes, fx
tracing, save/load, outputs, ...), which a model's test file runs by combining the mixin with a
tester of that model. The ``transformers-bert``, ``-gpt2`` and ``-t5`` cases run those tests on
testers of ours (tests/thirdparty_transformers/, copied beside the sdist's ``tests/`` in a fresh
tree for each case): ``test_modeling_common.py`` imports ``GenerationTesterMixin`` from
``tests/generation/test_utils.py``, which the sdist lacks, and gets our stand-in, whose one test
is the compiled-generation test (``test_generate_compile_model_forward_fullgraph``); the sdist's
``test_pipeline_mixin.py`` and ``test_configuration_common.py`` import modules it lacks and are
not used. The ``transformers-checkout-*`` cases run transformers' own model test files instead
(and its full generation mixin) from a checkout of transformers at the installed version, which
``TORCH_PALLAS_TRANSFORMERS_SOURCE`` names (its root, holding ``tests/``); they skip without one.

The runs use pytest's defaults, not the projects' own pytest configuration (PEFT's
``pyproject.toml`` has both ``[tool.pytest]`` and ``[tool.pytest.ini_options]``, which pytest 9
rejects, and adds ``--cov``); ``HF_HUB_OFFLINE=1`` (tests that need the Hub fail alike in every
run, or skip themselves); CPU tensors (``PJRT_DEVICE=CPU``). PEFT's helpers import ``diffusers``
and ``datasets`` at module level for tests that need the Hub: neither is installed, and the
plugin stubs them. transformers' ``test_modeling_common.py`` imports ``parameterized`` (in the
test extra; its cases skip without it).

``TORCH_PALLAS_THIRDPARTY_K`` narrows every case to a ``-k`` expression; ``TORCH_PALLAS_THIRDPARTY_REPORT``
names a folder that receives each case's outcomes (JSON) and logs.
"""

import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

PLUGIN = Path(__file__).with_name("thirdparty_plugin.py")
OURS = Path(__file__).parent
MODES = ("plain", "route", "convert")
PASS_TIMEOUT_S = int(os.environ.get("TORCH_PALLAS_THIRDPARTY_TIMEOUT", 4 * 3600))


@dataclasses.dataclass(frozen=True)
class Case:
    package: str
    files: tuple
    needs: tuple = ()          # further files of the package's tests/ the files import
    modules: tuple = ()        # test-only packages the files import
    k: str | None = None       # a -k expression: a representative part of a long file
    # Our files (relative to this folder) -> where they go in a copy of the sdist's tree (relative to
    # its root); a case with any runs in that copy, always from the sdist (no *_SOURCE override).
    ours: tuple = ()


TRANSFORMERS_COMMON = ("tests/test_modeling_common.py", "tests/generation/test_utils.py")
# Our model test modules beside the sdist's tests/ (tests/thirdparty_transformers/__init__.py).
TRANSFORMERS_OURS = (("thirdparty_transformers/__init__.py", "tests/thirdparty_transformers/__init__.py"),
                     ("thirdparty_transformers/extra_tests.py", "tests/thirdparty_transformers/extra_tests.py"),
                     ("thirdparty_transformers/generation/__init__.py", "tests/generation/__init__.py"),
                     ("thirdparty_transformers/generation/test_utils.py", "tests/generation/test_utils.py"))


def _transformers_ours(model: str) -> Case:
    module = f"thirdparty_transformers/test_{model}.py"
    return Case("transformers", (f"tests/{module}",), ("tests/test_modeling_common.py",), ("parameterized",),
                ours=((module, f"tests/{module}"), *TRANSFORMERS_OURS))


def _transformers_checkout(model: str) -> Case:
    return Case("transformers", (f"tests/models/{model}/test_modeling_{model}.py",), TRANSFORMERS_COMMON,
                ("parameterized",))


CASES = {
    # transformers' ModelTesterMixin (and our compiled-generation and train-mode fx/compile tests) on
    # testers of ours: about 120 tests each, 3 to 5 minutes a run here.
    **{f"transformers-{model}": _transformers_ours(model) for model in ("bert", "gpt2", "t5")},
    # transformers' own model test files, from a checkout (TORCH_PALLAS_TRANSFORMERS_SOURCE).
    **{f"transformers-checkout-{model}": _transformers_checkout(model) for model in ("bert", "gpt2", "t5")},
    # Every case of the file: 6507 tests, every tuner on PEFT's small custom models, about 10 minutes a
    # run here. 10 fail in every run (9 load models from the Hub; test_mixed_adapter_batches_lora_
    # unsupported_layer_raises meets torch_xla's GRU, which transformers' import of torch_xla brings).
    "peft-custom-models": Case("peft", ("tests/test_custom_models.py",), ("tests/testing_common.py",)),
}
MISSING_FROM_SDIST = {
    "transformers": "transformers' sdist on PyPI ships only tests/*_common.py (no tests/models, tests/generation), "
                    "and no registry has the rest: set TORCH_PALLAS_TRANSFORMERS_SOURCE to a checkout of "
                    "transformers {version} (its root, holding tests/), or run the transformers-bert/gpt2/t5 cases",
}


def _cache_root() -> Path:
    return Path(os.environ.get("TORCH_PALLAS_THIRDPARTY_CACHE",
                               Path.home() / ".cache" / "torch_pallas" / "thirdparty"))


def _download(package: str, version: str) -> Path:
    """The package's sdist ``tests/`` at ``version``, unpacked once into the cache (skips when the
    registry cannot be reached)."""
    target = _cache_root() / f"{package}-{version}"
    if (target / ".complete").exists():
        return target
    with tempfile.TemporaryDirectory() as download:
        result = subprocess.run([sys.executable, "-m", "pip", "download", f"{package}=={version}", "--no-binary",
                                 ":all:", "--no-deps", "-d", download],
                                capture_output=True, text=True, timeout=600)
        archives = list(Path(download).glob("*.tar.gz"))
        if result.returncode or not archives:
            pytest.skip(f"pip download {package}=={version} (sdist) failed: {result.stderr.strip()[-500:]}")
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        with tarfile.open(archives[0]) as archive:
            members = [member for member in archive.getmembers()
                       if member.name.partition("/")[2].startswith("tests/") and (member.isfile() or member.isdir())]
            for member in members:
                member.name = member.name.partition("/")[2]
            archive.extractall(target, members=members, filter="data")
    (target / ".complete").touch()
    return target


def _sources(case: Case, work: Path) -> Path:
    """The root of the tree the case's pytest runs in: the package's tests at the installed version,
    with our files of ``case.ours`` in a copy of it under ``work``."""
    version = importlib.metadata.version(case.package)
    given = None if case.ours else os.environ.get(f"TORCH_PALLAS_{case.package.upper()}_SOURCE")
    root = Path(given) if given else _download(case.package, version)
    theirs = case.needs if case.ours else case.files + case.needs
    missing = [name for name in theirs if not (root / name).is_file()]
    if missing:
        reason = MISSING_FROM_SDIST.get(case.package, "").format(version=version) if not given else ""
        pytest.skip(f"{', '.join(missing)} not in {root}" + (f": {reason}" if reason else ""))
    for module in case.modules:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{case.package}'s test files import {module}, which is not installed (pip install {module})")
    if not given and not (root / "tests" / "__init__.py").exists():
        (root / "tests" / "__init__.py").touch()  # the test files' relative imports need the package
    if case.ours:
        copy = work / "sources"
        shutil.copytree(root / "tests", copy / "tests", ignore=shutil.ignore_patterns(".complete"))
        for ours, destination in case.ours:
            (copy / destination).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(OURS / ours, copy / destination)
        root = copy
    return root


def _outcomes(junit: Path) -> dict:
    """``{test id: (outcome, first line of its error)}`` from pytest's JUnit XML, the worst of a
    test's reports (a teardown error after a pass is an error; a failed subtest, which pytest
    writes as one more ``<failure>`` of the test's element, fails the test whatever its last
    report, a pass or a skip)."""
    rank = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}
    outcomes = {}
    for testcase in ElementTree.parse(junit).iter("testcase"):
        test_id = f"{testcase.get('classname')}::{testcase.get('name')}"
        reports = [("passed", "")]
        for child in testcase:
            if child.tag in ("failure", "error", "skipped"):
                message = (child.get("message") or child.text or "").strip().splitlines()[:1]
                reports.append(({"failure": "failed"}.get(child.tag, child.tag), message[0] if message else ""))
        if test_id in outcomes:
            reports.append(outcomes[test_id])
        outcomes[test_id] = max(reports, key=lambda report: rank[report[0]])
    return outcomes


def _run_pass(root: Path, case: Case, mode: str, work: Path) -> tuple[dict, float]:
    plugin_dir = work / "plugin"
    plugin_dir.mkdir(exist_ok=True)
    shutil.copy(PLUGIN, plugin_dir / PLUGIN.name)  # alone on PYTHONPATH: no module of tests/ shadows theirs
    ini = work / "pytest.ini"
    ini.write_text("[pytest]\n")
    junit = work / f"{mode}.xml"
    env = {key: value for key, value in os.environ.items()
           if key not in ("RUN_SLOW", "PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PYTEST_XDIST_WORKER")}
    env.update(PYTHONPATH=str(plugin_dir), TORCH_PALLAS_AROUND_EACH_TEST=mode, HF_HUB_OFFLINE="1",
               PJRT_DEVICE="CPU", CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false",
               TORCH_PALLAS_THIRDPARTY_STUBS="diffusers,datasets")
    k = os.environ.get("TORCH_PALLAS_THIRDPARTY_K") or case.k
    command = [sys.executable, "-m", "pytest", "-p", "thirdparty_plugin", "-p", "no:cacheprovider", "-c", str(ini),
               "--rootdir", str(root), "--confcutdir", str(root), "-q", "--tb=short", "-rN", f"--junitxml={junit}",
               *case.files, *(("-k", k) if k else ())]
    start = time.monotonic()
    with open(work / f"{mode}.log", "w") as log:
        result = subprocess.run(command, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                timeout=PASS_TIMEOUT_S)
    seconds = time.monotonic() - start
    if result.returncode not in (0, 1) or not junit.exists():
        tail = (work / f"{mode}.log").read_text()[-3000:]
        pytest.fail(f"the {mode} run of {case.files} exited {result.returncode}:\n{tail}")
    return _outcomes(junit), seconds


@pytest.mark.slow
@pytest.mark.own_process
@pytest.mark.parametrize("name", CASES)
def test_no_test_that_passes_plain_fails_routed_or_converted(name, tmp_path):
    case = CASES[name]
    root = _sources(case, tmp_path)
    runs = {mode: _run_pass(root, case, mode, tmp_path) for mode in MODES}
    plain = runs["plain"][0]
    counts = {mode: {outcome: sum(1 for o, _ in outcomes.values() if o == outcome)
                     for outcome in ("passed", "failed", "error", "skipped")} | {"seconds": round(seconds)}
              for mode, (outcomes, seconds) in runs.items()}
    # A test that passes plain and fails, errors or is missing (its run crashed) in the other run.
    regressions = {mode: {test: outcomes.get(test, ("missing", "")) for test, (outcome, _) in plain.items()
                          if outcome == "passed" and outcomes.get(test, ("missing",))[0] not in ("passed", "skipped")}
                   for mode, (outcomes, _) in runs.items() if mode != "plain"}
    record = {"case": name, "files": case.files, "k": os.environ.get("TORCH_PALLAS_THIRDPARTY_K") or case.k,
              "counts": counts, "regressions": regressions,
              "failing_plain": {test: message for test, (outcome, message) in plain.items()
                                if outcome in ("failed", "error")}}
    print(json.dumps({key: record[key] for key in ("case", "counts", "regressions")}, indent=1))
    report = os.environ.get("TORCH_PALLAS_THIRDPARTY_REPORT")
    if report:
        Path(report).mkdir(parents=True, exist_ok=True)
        (Path(report) / f"{name}.json").write_text(json.dumps(record, indent=1))
        for mode in MODES:
            shutil.copy(tmp_path / f"{mode}.log", Path(report) / f"{name}-{mode}.log")
            shutil.copy(tmp_path / f"{mode}.xml", Path(report) / f"{name}-{mode}.xml")
    lines = [f"{mode}: {test}: {outcome}: {message}" for mode, tests in regressions.items()
             for test, (outcome, message) in tests.items()]
    assert not lines, f"{len(lines)} tests pass plain and not {'/'.join(MODES[1:])}:\n" + "\n".join(lines)
