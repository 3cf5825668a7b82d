"""The whole-program time estimate (:mod:`torch_pallas.tpu_schedule`): its arguments and errors
here; the estimates themselves in tests/estimates/, run in a process of their own with libtpu's
dumps enabled."""

import os
import re
from pathlib import Path
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from conftest import NEEDS_LIBTPU, ON_TPU, STACK
from torch_pallas import tpu_compile, tpu_schedule

pytestmark = [
    pytest.mark.tpu_compile,
    pytest.mark.skipif(ON_TPU, reason="on a TPU the suite compiles and runs the kernels for real"),
    NEEDS_LIBTPU,
]

KEY = jax.ShapeDtypeStruct((2,), jnp.int32)


def test_estimates_run_in_their_own_process_with_the_dumps_enabled():
    """tests/estimates/: an XLA-only program is the sum of its fusions and grows with its size;
    the dropout kernel agrees with bench/results/tpu_cost.md; kernels sharing code share its
    schedule; a top-level loop is refused; on the xla stack, a GPT-2 step's estimate covers its
    fusions and kernels."""
    env = dict(os.environ, TORCH_PALLAS_TPU_ESTIMATES="1")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "estimates"],
                            cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-4000:]
    # Every estimate test ran there, none skipped: test_tpu_schedule's 4, and on the xla stack
    # test_step_estimate's 2 (torchax has no torch_xla graph to compile: that module skips).
    summary = result.stdout.strip().splitlines()[-1]
    counts = dict((outcome, int(number)) for number, outcome in re.findall(r"(\d+) (\w+)", summary))
    counts.pop("warning", None), counts.pop("warnings", None)
    assert counts == ({"passed": 6} if STACK == "xla" else {"passed": 4, "skipped": 1}), summary


def test_bad_arguments_and_unestablished_generations_raise_clearly():
    with pytest.raises(NotImplementedError, match="tpu7x: clock not established"):
        tpu_schedule.estimate({}, "tpu7x")
    with pytest.raises(ValueError, match="generation must be one of 'v4'.*got 'v9'"):
        tpu_schedule.estimate({}, "v9")
    with pytest.raises(ValueError, match="exactly one compiled program"):
        tpu_schedule.estimate({}, "v5e")
    with pytest.raises(TypeError, match="estimate must be True or False"):
        tpu_compile.analyze_for_tpu(jnp.sin, KEY, generation="v5e", estimate="yes")
    step = tpu_schedule.StepEstimate("v5e", 1, 1e-9, ())
    with pytest.raises(ValueError, match="top must be a positive int, got 0"):
        step.table(top=0)


@pytest.mark.skipif(tpu_compile._libtpu["dump_directory"] is not None,
                    reason="this process enabled estimates (TORCH_PALLAS_TPU_ESTIMATES=1) before libtpu started")
def test_estimates_enabled_after_libtpu_started_raise_with_the_flags():
    # In this process, as in the suite's: estimates are enabled only in tests/estimates' own process.
    tpu_compile.tpu_device("v5e")
    with pytest.raises(RuntimeError, match="enable_estimates must be called before"):
        tpu_compile.enable_estimates()
    assert tpu_compile._libtpu["dump_directory"] is None  # the refusal changed nothing
