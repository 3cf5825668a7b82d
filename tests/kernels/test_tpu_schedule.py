"""The whole-program time estimate (:mod:`torch_pallas.tpu_schedule`): its arguments and errors
here, and the control flow it follows in hand-written dumps; the estimates of compiled programs
in tests/estimates/, run in a process of their own with libtpu's dumps enabled."""

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

KEY = jax.ShapeDtypeStruct((2,), jnp.int32)


def compiles_for_tpu(test):
    """The TPU-compile tier's marks: the test compiles with libtpu's compile-only client."""
    for mark in (pytest.mark.tpu_compile, NEEDS_LIBTPU,
                 pytest.mark.skipif(ON_TPU, reason="on a TPU the suite compiles and runs the kernels for real")):
        test = mark(test)
    return test


# Hand-written final_bundles dumps, worded as libtpu 0.0.21 words them: scalar ops, then a branch.
BRANCH_ON_DATA = """\
  0x0   :  { %s1_s1 = sld [smem:[#allocation2]] }
  0x1   :  { %p2_p2 = scmp.eq.s32.totalorder %s1_s1, 0 ;; %s3_s3 = sadd.s32 %s1_s1, 1 }
  0x2   :  { %s4_s4 = smov 7 ;; sbr.rel (%p2_p2) target bundleno = 9 (0x9), region = 3 }
  0x3   :  { %s5_s5 = sadd.s32 %s4_s4, 1 }
"""
# The same branch on a known value, to region 3 (marked nowhere in UNMARKED_TARGET, at bundle 5 in
# FORWARD_BRANCH).
UNMARKED_TARGET = BRANCH_ON_DATA.replace("sld [smem:[#allocation2]]", "smov 0")
FORWARD_BRANCH = UNMARKED_TARGET + """\
  0x4   :  { %s6_s6 = smov 2 }
  0x5 PF:  { %s7_s7 = smov 3 /* Start/End empty region 3 */ }
"""


@pytest.mark.parametrize("dump, error", [
    # A key word read from SMEM is unknown, and so is the compare of it the branch reads.
    (BRANCH_ON_DATA, r"the branch at bundle 2 depends on an unknown predicate \(p2\)"),
    (UNMARKED_TARGET, r"no target for the branch at bundle 2 \(bundle number 9, region 3\)"),
])
def test_schedule_errors_name_the_dump_after_scalar_ops(dump, error):
    # Each dump runs scalar ops (sld or smov, scmp, sadd) before its branch: the message names the
    # dump, not the last opcode run.
    with pytest.raises(ValueError, match="^kernel.3: " + error):
        tpu_schedule.executed_schedule(dump, "v5e", name="kernel.3")
    with pytest.raises(ValueError, match="^the dump: " + error):
        tpu_schedule.executed_schedule(dump, "v5e")
    # What estimate counts instead: the static schedule, each bundle once (no loops).
    assert tpu_schedule.executed_or_static_schedule(dump, "v5e", name="kernel.3") == (
        {"bundles": 4, "hbm_dma_bytes": None}, False)


def test_a_branch_on_known_values_is_taken_after_its_delay_slots():
    # v4 has one delay slot: bundle 3 issues, then the branch lands on region 3's mark, bundle 5.
    run, followed = tpu_schedule.executed_or_static_schedule(FORWARD_BRANCH, "v4")
    assert followed and run["counts"] == [1, 1, 1, 1, 0, 1] and run["bundles"] == 5
    assert run["hbm_dma_bytes"] == 0 and run["ops"][2] == ["smov"]
    # v5e has four: bundles 3 to 5 issue in them (the dump ends in the fourth).
    assert tpu_schedule.executed_schedule(FORWARD_BRANCH, "v5e")["counts"] == [1] * 6


# A loop of three iterations behind a branch on the TensorCore's index (core 0 runs it), worded as
# libtpu 0.0.52 words it (copied from its IndRNN kernel's dump, cut down), and as 0.0.21 does.
LOOP_0_0_52 = """\
     0   :  { %s6_s15 = sld [smem:[#allocation0]] /* megacore core id :: core id */ }
   0x1   :  { %p7_p0 = scmp.ne.s32.totalorder %s6_s15, 0  ;;  %s641_s1 = smov.u32 0 /* copy for cssa */ }
   0x2   :  { %16 = sbr.rel (%p7_p0) target = $region9 }
   0x3   :  {}
   0x4 LB: > { %s82_s1 = sadd.s32 1, %s587_s1 /* copy for cssa */  ;;  %s587_s1 = sphi %s641_s1, %s82_s1 } /* Start region 5 */
   0x5   : > { %p79_p0 = scmp.ge.s32.totalorder %s82_s1, 3 /* loop exit test */ }
   0x6   :  { %81 = sbr.rel (!%p79_p0) target = $region5 }
   0x7   : > { %v9_v0 = vadd.f32 %v9_v0, %v9_v0 } /* End region 5 */
   0x8 PF:  {} /* Start/End empty region 9 */
"""
LOOP_0_0_21 = (LOOP_0_0_52.replace("megacore core id :: core id", "core id").replace("smov.u32", "smov")
               .replace("target = $region9", "target bundleno = 8 (0x8), region = 9")
               .replace("target = $region5", "target bundleno = 4 (0x4), region = 5"))


@pytest.mark.parametrize("dump", [LOOP_0_0_21, LOOP_0_0_52], ids=["libtpu-0.0.21", "libtpu-0.0.52"])
def test_a_loop_is_followed_as_either_libtpu_words_it(dump):
    # v4: one delay slot after each branch; the loop body (bundles 4 to 7) runs three times.
    run = tpu_schedule.executed_schedule(dump, "v4")
    assert run["counts"] == [1, 1, 1, 1, 3, 3, 3, 3, 1] and run["bundles"] == 17


# The same loop after long bundles (instruction words, which bundle numbers count, outnumber the
# bundles): its closing branch's bundle number (12) is past its own index (6), yet it goes back to
# the loop's head; the dump ends in the kernel's exit bundle, where a branch forward could land.
LOOP_AFTER_LONG_BUNDLES = (LOOP_0_0_21.replace("target bundleno = 4 (0x4), region = 5",
                                                "target bundleno = 12 (0xc), region = 5")
                           .replace("/* Start/End empty region 9 */",
                                    "/* Start/End empty region 9 */ /* exit bundle: %k.1 = custom-call() */"))


def test_a_loop_closes_on_its_head_whatever_its_bundle_number():
    # Once read as a branch forward, to the exit bundle: the body ran once (9 bundles, not 17).
    run = tpu_schedule.executed_schedule(LOOP_AFTER_LONG_BUNDLES, "v4")
    assert run["counts"] == [1, 1, 1, 1, 3, 3, 3, 3, 1] and run["bundles"] == 17


@compiles_for_tpu
@pytest.mark.own_process
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


def test_vector_work_takes_every_valu_slot_of_every_tensor_core():
    assert tpu_schedule.valu_seconds("v5e", 4 * 1.5e9) == pytest.approx(1.0)  # one TensorCore, 4 slots at 1.5 GHz
    assert tpu_schedule.valu_seconds("v5p", 2 * 4 * 1.75e9) == pytest.approx(1.0)  # a megacore's two
    assert tpu_schedule.valu_seconds("v4", 2 * 2 * 1.05e9) == pytest.approx(1.0)
    with pytest.raises(NotImplementedError, match="tpu7x: clock, valu_slots not established"):
        tpu_schedule.valu_seconds("tpu7x", 1)


@compiles_for_tpu
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


@compiles_for_tpu
@pytest.mark.skipif(tpu_compile._libtpu["dump_directory"] is not None,
                    reason="this process enabled estimates (TORCH_PALLAS_TPU_ESTIMATES=1) before libtpu started")
def test_estimates_enabled_after_libtpu_started_raise_with_the_flags():
    # In this process, as in the suite's: estimates are enabled only in tests/estimates' own process.
    tpu_compile.tpu_device("v5e")
    with pytest.raises(RuntimeError, match="enable_estimates must be called before"):
        tpu_compile.enable_estimates()
    assert tpu_compile._libtpu["dump_directory"] is None  # the refusal changed nothing


@pytest.mark.parametrize("op,unit", [
    ("vadd.s32", "VALU"), ("vsel", "VALU"), ("vcmp.lt.s32.totalorder", "VALU"), ("vmatpush.msra.mxu0", "MXU"),
    ("vmatmul.f32.gmr.mxu1", "MXU"), ("vpop.f32.mrf.xlu0", "XLU"), ("vpow2.f32", "EUP"), ("vpop.eup", "EUP"),
    ("vld", "vld"), ("vstv", "vst"), ("vst.msk", "vst"), ("vmand", None), ("vrng", None), ("vsyncadd", None),
    ("sadd.s32", None)])
def test_bundle_ops_are_told_by_the_unit_that_issues_them(op, unit):
    """What the VALU counts leave out: other units' ops, loads and stores, and ops that take no ALU slot
    (mask logic, the hardware PRNG's draw, syncs, scalar ops)."""
    assert tpu_schedule.vector_unit(op) == unit
