"""Suite-wide set-up: the stack (torch_xla's, torchax's or TorchTPU's: whichever this environment
has), its device (CPU unless PJRT_DEVICE says otherwise) and TPU gating.

``tests/kernels`` (pure JAX) runs on the torch_xla and torchax stacks, ``tests/distributed`` (DTensors on
real processes) on the torch_xla and TorchTPU stacks; the other ``tests/test_*.py`` test the
torch_xla stack, ``tests/torchax`` the torchax stack and ``tests/torchtpu`` the TorchTPU stack;
each stack's run skips the others'.
"""

import importlib.util
import itertools
import os

os.environ.setdefault("PJRT_DEVICE", "CPU")
if os.environ["PJRT_DEVICE"] != "TPU":
    # Off TPU, libtpu is only the compiler of the TPU-compile tier: let a second process
    # (a parallel run, a subprocess test) load it too instead of failing on its lock file.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    # XLA's CPU compiles are most of the suite's time (a kernel in interpret mode is a large
    # loop program): with LLVM's optimizations off, a third of the CPU time for the same tests
    # and results (the noise is integer work; float results are compared with tolerances that
    # hold at either level). libtpu's TPU compiles ignore it: the estimates of tests/estimates'
    # programs are the same with and without it, on both libtpus. The benchmarks keep XLA's default.
    if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
    if importlib.util.find_spec("torch_xla") is None:
        # torchax's JAX would otherwise try libtpu's TPU backend first (torch_xla's CPU
        # client keeps JAX on the CPU itself: torch_pallas.frontends.xla).
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if importlib.util.find_spec("torch_tpu") is not None:
        # torch loads torch_tpu at import; without these, libtpu waits minutes for cloud
        # metadata the first time tests/torchtpu registers the tpu device without a TPU.
        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")

import pytest  # noqa: E402

import torch_pallas  # noqa: E402,F401  (torch_xla's client before JAX)
from torch_pallas import bridge, tpu_compile  # noqa: E402

STACK = bridge.STACK
ON_TPU = bridge.on_tpu()
# tests/estimates/ reads libtpu's dumps of what it compiles (tpu_compile.enable_estimates), which
# libtpu must be told when it initialises and which slow every compile: tests/kernels/
# test_tpu_schedule.py runs them in a process of their own, which sets this variable.
ESTIMATES = os.environ.get("TORCH_PALLAS_TPU_ESTIMATES") == "1"
if ESTIMATES:
    tpu_compile.enable_estimates()

NEEDS_LIBTPU = pytest.mark.skipif(not tpu_compile.available(), reason=(
    "libtpu (the TPU compiler) is not installed: ./dev test, or pip install -e '.[test]', installs "
    "the libtpu its constraints pin (0.0.21 beside torch_xla 2.9, 0.0.52 beside jax 0.10)"))

# tests/spmd/ needs SPMD mode, which is process-wide: test_sharding.py runs it in a process of
# its own (which sets TORCH_PALLAS_HLO_DUMP); tests/torchax/spmd likewise.
collect_ignore = [] if os.environ.get("TORCH_PALLAS_HLO_DUMP") else ["spmd", "torchax/spmd"]
if not ESTIMATES:
    collect_ignore += ["estimates"]
collect_ignore_glob = []
if STACK != "xla":
    collect_ignore += ["spmd"]
    collect_ignore_glob += ["test_*.py"]
if STACK != "torchax":
    collect_ignore += ["torchax"]
else:
    # DTensors are CPU tensors here: the torch_xla and TorchTPU stacks (torch 2.9, 2.14) run them.
    collect_ignore += ["distributed"]
if STACK != "torchtpu":
    collect_ignore += ["torchtpu"]
else:
    # The torchax stack runs the kernel tier with the same jax and libtpu.
    collect_ignore += ["kernels"]


def on_a_device_without_front_end(*shape, dtype=None):
    """A tensor on CUDA, made without it (a fake tensor): a device torch_pallas has no front end
    for, whose tensors its ops refuse naming the fix (meta tensors, which hold no values either,
    are taken: shapes only)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.zeros(shape, dtype=dtype, device="cuda")


def crossed(fast, **axes):
    """``pytest.param``s for every combination of the values of ``axes`` (each an argument name
    mapped to ``{id: value}``, or to strings that are their own ids), in the order given; the
    combinations whose ids are not in ``fast`` are in the slow tier. ``fast`` covers each value of
    each axis (and, where it matters, each pair), so what the slow tier adds are combinations of
    parts checked separately."""
    axes = {name: axis if isinstance(axis, dict) else {value: value for value in axis} for name, axis in axes.items()}
    combinations = list(itertools.product(*axes.values()))
    assert set(fast) <= set(combinations), f"{set(fast) - set(combinations)} is no combination of {list(axes)}"
    return [pytest.param(*[axis[id_] for axis, id_ in zip(axes.values(), ids)], id="-".join(ids),
                         marks=() if ids in fast else pytest.mark.slow) for ids in combinations]


def read_together(*groups) -> list:
    """Each group of the torch_xla stack's lazy tensors on the CPU, all computed by one graph: read
    one at a time, each tensor compiles a graph of its own, with every interpret-mode kernel it
    needs in it."""
    import torch_xla

    torch_xla.sync()
    return [[tensor.cpu() for tensor in group] for group in groups]


def covered_on_the_newest_jax(test):
    """A kernel test that compares two of the library's own kernels (a layout, planes per grid
    step, a transposed read), sweeps a property of bits every JAX draws alike (block invariance,
    statistics: the known answers pin the bits on each stack), or checks what the torch-level
    suite checks on every stack against the same reference: the torchax stack's jax 0.10 runs it
    in every ``./dev test``, and on older JAX (the xla stack's 0.7.1) it is in the slow tier."""
    from torch_pallas.kernels import compat

    return pytest.mark.slow(test) if compat.JAX_VERSION < (0, 10) else test


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true",
                     help="also run the slow tier: tests marked slow (long; their checks are covered faster elsewhere)")


def pytest_collection_modifyitems(config, items):
    # The longest tests first: the workers' short tests then fill in around them, where one left
    # for last keeps one worker busy while the other has nothing left to take.
    items.sort(key=lambda item: "own_process" not in item.keywords)
    if not config.getoption("--slow"):
        slow = pytest.mark.skip(reason="the slow tier (covered faster elsewhere): ./dev test --slow runs it")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(slow)
    if ON_TPU:
        return
    where = ("a TPU VM (TorchTPU finds no TPU here)" if STACK == "torchtpu"
             else f"PJRT_DEVICE=TPU (this run: PJRT_DEVICE={os.environ['PJRT_DEVICE']})")
    skip = pytest.mark.skip(
        reason=f"needs a TPU: compiled Mosaic kernels and the hardware PRNG run only there; needs {where}")
    for item in items:
        if "tpu" in item.keywords:
            item.add_marker(skip)


def pytest_report_header(config):
    return (f"torch_pallas: the {STACK} stack, PJRT_DEVICE={os.environ['PJRT_DEVICE']}, "
            f"Pallas interpret mode: {bridge.interpret_mode()}")
