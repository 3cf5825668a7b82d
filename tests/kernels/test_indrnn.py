"""Tests for torch_pallas.kernels.indrnn (JAX only; kernels run in interpret mode on CPU).

Every kernel is checked against a float64 NumPy loop, across block shapes that
leave ragged time, batch and feature edges (TPU compilation: test_tpu_compile.py).
Shapes are reused so that the file compiles few kernels.
"""

from __future__ import annotations


import jax.numpy as jnp
import numpy as np
import pytest

from conftest import covered_on_the_newest_jax
from reference import indrnn_reference, indrnn_reference_gradients, indrnn_reference_with_lengths
from torch_pallas.kernels import indrnn
from torch_pallas.kernels.tiling import RecurrenceBlocks, resolve_recurrence

FORWARD_RTOL = 1e-5
GRADIENT_RTOL = 1e-4
# bfloat16 stores outputs and input gradients with an 8-bit mantissa (eps 2**-8);
# state and accumulation are float32, so errors stay near one rounding.
BFLOAT16_RTOL = 2e-2


def reference_indrnn(x, weight, h0, grad_output, grad_h_n, nonlinearity):
    """Forward and backward in float64: (output, h_n, grad_x, grad_weight, grad_h0)."""
    output, h_n = indrnn_reference(x, weight, h0, nonlinearity)
    return (output, h_n, *indrnn_reference_gradients(output, weight, h0, grad_output, grad_h_n, nonlinearity))


def relative_error(actual, expected) -> float:
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30))


def random_problem(T, B, F, *, seed=0, weight_range=(-1.0, 1.0), dtype=np.float32):
    rng = np.random.default_rng(seed)
    return dict(
        x=rng.standard_normal((T, B, F)).astype(dtype),
        weight=rng.uniform(*weight_range, size=F).astype(np.float32),
        h0=rng.standard_normal((B, F)).astype(np.float32),
        grad_output=rng.standard_normal((T, B, F)).astype(dtype),
        grad_h_n=rng.standard_normal((B, F)).astype(dtype),
    )


def run_kernels(problem, nonlinearity, blocks=None):
    output, h_n = indrnn.indrnn_forward(
        problem["x"], problem["weight"], problem["h0"], nonlinearity=nonlinearity, interpret=True, blocks=blocks)
    grads = indrnn.indrnn_backward(
        problem["grad_output"], problem["grad_h_n"], output, problem["weight"], problem["h0"],
        nonlinearity=nonlinearity, interpret=True, blocks=blocks)
    return (output, h_n, *grads)


RESULT_NAMES = ("output", "h_n", "grad_x", "grad_weight", "grad_h0")


def assert_matches_reference(results, problem, nonlinearity, *, forward_rtol, gradient_rtol):
    expected = reference_indrnn(
        problem["x"], problem["weight"], problem["h0"], problem["grad_output"], problem["grad_h_n"], nonlinearity
    )
    for name, actual, wanted in zip(RESULT_NAMES, results, expected):
        rtol = forward_rtol if name in ("output", "h_n") else gradient_rtol
        error = relative_error(actual, wanted)
        assert error <= rtol, f"{name}: relative error {error:.3g} > {rtol:g}"


# (T, B, F), blocks. The ragged case has T = 4*8 + 5, B = 8 + 4, F = 128 + 72:
# partial blocks on every axis, and several time blocks for the carried state.
CASES = {
    "aligned": ((16, 8, 128), None),
    "ragged_blocks": ((37, 12, 200), RecurrenceBlocks(8, 8, 128)),
    "single_step": ((1, 3, 5), None),
}


# ------------------------------------------------------------------ correctness


@pytest.mark.parametrize("nonlinearity", ["relu", "tanh"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_float64_reference(case, nonlinearity):
    shape, blocks = CASES[case]
    problem = random_problem(*shape)
    results = run_kernels(problem, nonlinearity, blocks)
    for name, result, dtype in zip(RESULT_NAMES, results, (np.float32,) * 5):
        assert result.dtype == dtype, name
    assert_matches_reference(
        results, problem, nonlinearity, forward_rtol=FORWARD_RTOL, gradient_rtol=GRADIENT_RTOL
    )


@pytest.mark.parametrize("nonlinearity", ["relu", "tanh"])
def test_block_shape_does_not_change_results(nonlinearity):
    """Bit-identical results whatever the blocks: the whole array, ragged blocks, a
    time block that does not divide T and leaves a one-step tail."""
    shape, ragged_blocks = CASES["ragged_blocks"]
    problem = random_problem(*shape)
    baseline = run_kernels(problem, nonlinearity, blocks=None)
    for blocks in (ragged_blocks, RecurrenceBlocks(6, 12, 200)):
        results = run_kernels(problem, nonlinearity, blocks)
        for name, expected, actual in zip(RESULT_NAMES, baseline, results):
            np.testing.assert_array_equal(np.asarray(actual), np.asarray(expected), err_msg=f"{name} {blocks}")


def test_partially_unrolled_time_loop():
    """The TPU path unrolls the time loop by hand (groups plus a static remainder);
    force that path in interpret mode, with ragged time blocks."""
    shape, _ = CASES["ragged_blocks"]
    problem = random_problem(*shape)
    results = run_kernels(problem, "tanh", RecurrenceBlocks(8, 8, 128, unroll=3))
    assert_matches_reference(results, problem, "tanh", forward_rtol=FORWARD_RTOL, gradient_rtol=GRADIENT_RTOL)


# Ragged lengths over the ragged case's 12 rows: full, 0, 1, ends inside and at the edge of
# a time block (blocks of 8), past T (clipped), negative (as 0).
LENGTHS = np.array([37, 0, 1, 8, 9, 16, 36, 20, 40, 5, -3, 33], np.int32)


@pytest.mark.parametrize("nonlinearity", ["relu", "tanh"])
def test_lengths_stop_each_row_at_its_own_step(nonlinearity):
    shape, blocks = CASES["ragged_blocks"]
    problem = random_problem(*shape, seed=3)
    options = dict(nonlinearity=nonlinearity, interpret=True)
    expected = indrnn_reference_with_lengths(problem["x"], problem["weight"], problem["h0"], LENGTHS,
                                             problem["grad_output"], problem["grad_h_n"], nonlinearity)
    for forced in (blocks, RecurrenceBlocks(6, 12, 200, unroll=4)):
        output, h_n = indrnn.indrnn_forward(problem["x"], problem["weight"], problem["h0"], LENGTHS,
                                            blocks=forced, **options)
        gradients = indrnn.indrnn_backward(problem["grad_output"], problem["grad_h_n"], output, problem["weight"],
                                           problem["h0"], LENGTHS, blocks=forced, **options)
        for name, actual, wanted in zip(RESULT_NAMES, (output, h_n, *gradients), expected):
            rtol = FORWARD_RTOL if name in ("output", "h_n") else GRADIENT_RTOL
            assert relative_error(actual, wanted) <= rtol, f"{name} with {forced}"
        np.testing.assert_array_equal(np.asarray(output)[:, 1], 0)  # the length-0 row
        np.testing.assert_array_equal(np.asarray(h_n)[1], problem["h0"][1])


def test_full_lengths_equal_no_lengths_bit_for_bit():
    shape, blocks = CASES["ragged_blocks"]
    problem = random_problem(*shape)
    full = np.full(shape[1], shape[0], np.int32)
    without = run_kernels(problem, "tanh", blocks)
    options = dict(nonlinearity="tanh", interpret=True, blocks=blocks)
    output, h_n = indrnn.indrnn_forward(problem["x"], problem["weight"], problem["h0"], full, **options)
    gradients = indrnn.indrnn_backward(problem["grad_output"], problem["grad_h_n"], output, problem["weight"],
                                       problem["h0"], full, **options)
    for name, expected, actual in zip(RESULT_NAMES, without, (output, h_n, *gradients)):
        np.testing.assert_array_equal(np.asarray(actual), np.asarray(expected), err_msg=name)


def test_bfloat16_inputs():
    shape, blocks = CASES["ragged_blocks"]
    problem = random_problem(*shape)
    problem["x"] = jnp.asarray(problem["x"], jnp.bfloat16)
    problem["grad_output"] = jnp.asarray(problem["grad_output"], jnp.bfloat16)
    problem["grad_h_n"] = jnp.asarray(problem["grad_h_n"], jnp.bfloat16)
    problem["h0"] = jnp.asarray(problem["h0"], jnp.bfloat16)
    results = run_kernels(problem, "tanh", blocks)
    output, h_n, grad_x, grad_weight, grad_h0 = results
    assert output.dtype == h_n.dtype == grad_x.dtype == jnp.bfloat16
    assert grad_weight.dtype == jnp.float32  # the weight's dtype
    assert grad_h0.dtype == jnp.bfloat16  # h0's dtype
    # The reference sees exactly the bfloat16 values the kernel saw.
    problem = {name: np.asarray(jnp.asarray(value, jnp.float32)) for name, value in problem.items()}
    assert_matches_reference(results, problem, "tanh", forward_rtol=BFLOAT16_RTOL, gradient_rtol=BFLOAT16_RTOL)


def test_float16_is_the_float32_kernel_rounded_once():
    """Mosaic has no float16: float16 arrays run through the float32 kernel (exact widening)
    and every result is rounded to float16 once, so CPU and TPU agree."""
    shape, blocks = CASES["ragged_blocks"]
    problem = {name: jnp.asarray(value, jnp.float16) for name, value in random_problem(*shape).items()}
    x, weight, h0, grad_output, grad_h_n = (problem[name] for name in ("x", "weight", "h0", "grad_output", "grad_h_n"))
    options = dict(nonlinearity="tanh", interpret=True, blocks=blocks)

    def widened(function, *arrays):
        return [result.astype(jnp.float16) for result in function(*(a.astype(jnp.float32) for a in arrays), **options)]

    output, h_n = indrnn.indrnn_forward(x, weight, h0, **options)
    gradients = indrnn.indrnn_backward(grad_output, grad_h_n, output, weight, h0, **options)
    expected = widened(indrnn.indrnn_forward, x, weight, h0) + widened(
        indrnn.indrnn_backward, grad_output, grad_h_n, output, weight, h0)
    for name, got, wanted in zip(RESULT_NAMES, (output, h_n, *gradients), expected):
        assert got.dtype == jnp.float16, name
        np.testing.assert_array_equal(np.asarray(got), np.asarray(wanted), err_msg=name)


def test_bfloat16_state_and_gradient_carry_are_float32():
    """1 + 2**-9 rounds back to 1 in bfloat16, so a bfloat16 state would stay at 1
    while a float32 state reaches 1 + 256 * 2**-9 = 1.5 (exact in bfloat16). The same
    holds for the backward carry, with grad_output = 2**-9 and grad_h_n = 1."""
    T, B, F = 256, 8, 128
    small = jnp.full((T, B, F), 2.0**-9, jnp.bfloat16)
    ones = jnp.ones((B, F), jnp.bfloat16)
    weight = jnp.ones((F,), jnp.float32)
    output, h_n = indrnn.indrnn_forward(small, weight, ones, nonlinearity="relu", interpret=True)
    np.testing.assert_array_equal(np.asarray(h_n, np.float32), 1.5)
    _, grad_weight, grad_h0 = indrnn.indrnn_backward(
        small, ones, output, weight, ones.astype(jnp.float32), nonlinearity="relu", interpret=True
    )
    np.testing.assert_array_equal(np.asarray(grad_h0), 1.5)
    assert np.all(np.isfinite(np.asarray(grad_weight)))


@covered_on_the_newest_jax
@pytest.mark.parametrize("weight_range", [(1.0, 1.0), (0.0, 1.0)], ids=["w=1", "w~U(0,1)"])
def test_benchmark_shape(weight_range):
    """The benchmark's problem: T=1000, B=1, F=1000, relu, h0=0."""
    problem = random_problem(1000, 1, 1000, seed=1, weight_range=weight_range)
    problem["h0"] = np.zeros_like(problem["h0"])
    problem["grad_h_n"] = np.zeros_like(problem["grad_h_n"])
    results = run_kernels(problem, "relu")
    assert_matches_reference(results, problem, "relu", forward_rtol=FORWARD_RTOL, gradient_rtol=GRADIENT_RTOL)


def test_empty_sequence_returns_initial_state():
    x = np.zeros((0, 2, 3), np.float32)
    weight = np.ones(3, np.float32)
    h0 = np.arange(6, dtype=np.float32).reshape(2, 3)
    output, h_n = indrnn.indrnn_forward(x, weight, h0, nonlinearity="relu", interpret=True)
    assert output.shape == (0, 2, 3)
    np.testing.assert_array_equal(h_n, h0)
    grad_x, grad_weight, grad_h0 = indrnn.indrnn_backward(
        x, h0, output, weight, h0, nonlinearity="relu", interpret=True
    )
    assert grad_x.shape == (0, 2, 3)
    np.testing.assert_array_equal(grad_weight, 0.0)
    np.testing.assert_array_equal(grad_h0, h0)


# ------------------------------------------------------------- arguments, blocks


def test_rejects_unknown_nonlinearity():
    x, weight, h0 = np.zeros((2, 1, 4), np.float32), np.zeros(4, np.float32), np.zeros((1, 4), np.float32)
    with pytest.raises(ValueError, match="relu.*tanh"):
        indrnn.indrnn_forward(x, weight, h0, nonlinearity="sigmoid", interpret=True)
    with pytest.raises(ValueError, match="relu.*tanh"):
        indrnn.indrnn_backward(x, h0, x, weight, h0, nonlinearity="gelu", interpret=True)


@pytest.mark.parametrize("blocks,error", [((0, 8, 128), ValueError), ((8.0, 8, 128), TypeError),
                                          ((8, True, 128), TypeError)])
def test_rejects_non_positive_int_blocks(blocks, error):
    with pytest.raises(error, match="RecurrenceBlocks"):
        RecurrenceBlocks(*blocks)


@pytest.mark.parametrize("blocks", [RecurrenceBlocks(8, 5, 128), RecurrenceBlocks(8, 8, 100), (8, 8, 128), "auto"])
def test_rejects_invalid_blocks(blocks):
    x, weight, h0 = np.zeros((37, 12, 200), np.float32), np.zeros(200, np.float32), np.zeros((12, 200), np.float32)
    error = ValueError if isinstance(blocks, RecurrenceBlocks) else TypeError
    with pytest.raises(error, match="blocks"):
        indrnn.indrnn_forward(x, weight, h0, nonlinearity="relu", interpret=True, blocks=blocks)
    with pytest.raises(error, match="blocks"):
        indrnn.indrnn_backward(x, h0, x, weight, h0, nonlinearity="relu", interpret=True, blocks=blocks)


def test_rejects_bad_lengths():
    x, weight, h0 = np.zeros((4, 2, 8), np.float32), np.zeros(8, np.float32), np.zeros((2, 8), np.float32)
    for lengths in (np.array([1, 2, 3], np.int32), np.array([1.0, 2.0], np.float32)):
        with pytest.raises(ValueError, match="lengths"):
            indrnn.indrnn_forward(x, weight, h0, lengths, nonlinearity="relu", interpret=True)


def test_rejects_mismatched_shapes():
    x = np.zeros((4, 2, 8), np.float32)
    with pytest.raises(ValueError, match="weight"):
        indrnn.indrnn_forward(x, np.zeros(7, np.float32), np.zeros((2, 8), np.float32), nonlinearity="relu", interpret=True)
    with pytest.raises(ValueError, match="h0"):
        indrnn.indrnn_forward(x, np.zeros(8, np.float32), np.zeros((3, 8), np.float32), nonlinearity="relu", interpret=True)
    with pytest.raises(ValueError, match="grad_output"):
        indrnn.indrnn_backward(
            x[:3], np.zeros((2, 8), np.float32), x, np.zeros(8, np.float32), np.zeros((2, 8), np.float32),
            nonlinearity="relu", interpret=True,
        )


@pytest.mark.parametrize(
    "shape",
    [(16, 8, 128), (37, 3, 200), (1000, 1, 1000), (512, 64, 512), (300, 40, 1100), (100000, 256, 4096), (1, 1, 1)],
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_default_blocks(shape, dtype):
    T, B, F = shape
    assert resolve_recurrence(None, T, B, F, dtype, interpret=True) == RecurrenceBlocks(T, B, F, unroll=1)
    blocks = resolve_recurrence(None, T, B, F, dtype, interpret=False)
    assert 0 < blocks.time <= min(T, 256)
    assert blocks.batch == B or (blocks.batch % 8 == 0 and blocks.batch < B)
    assert blocks.features == F or (blocks.features % 128 == 0 and blocks.features < F)
    # One block, padded to whole (sublane, lane) tiles, is at most 1 MiB, so the
    # backward's three double-buffered streams fit the default scoped VMEM.
    itemsize = np.dtype(dtype).itemsize
    sublanes = 8 * (4 // itemsize)
    padded_bytes = blocks.time * (-(-blocks.batch // sublanes) * sublanes) * (-(-blocks.features // 128) * 128) * itemsize
    assert padded_bytes <= 1 << 20
