"""``dropout(x) @ weight.T`` in one kernel: its mask is the dropout kernel's for the same key, bit
for bit, on both impls that run here; values and both gradients against float64 references given
that mask, with rows that end inside a block (TPU compilation: test_tpu_compile.py)."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from conftest import covered_on_the_newest_jax
from reference import key_data
from torch_pallas.kernels import dropout, dropout_linear

KEY = jnp.asarray(key_data(1234))
# x's shape, N: LoRA's skinny rank over rows that end inside a tile; a 3-D activation whose 384
# features take (16, 128) tiles; a wide N over 1024 features.
CASES = [((100, 1024), 16), ((3, 5, 384), 8), ((2, 64, 256), 128)]
IMPLS = ["tiled", "threefry"]


def _case(x_shape, N, dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(keys[0], x_shape, jnp.float32).astype(dtype)
    weight = (jax.random.normal(keys[1], (N, x_shape[-1]), jnp.float32) / 16).astype(dtype)
    grad_out = jax.random.normal(keys[2], (*x_shape[:-1], N), jnp.float32).astype(dtype)
    return x, weight, grad_out


def _f64(array):
    return np.asarray(array, np.float64)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("x_shape,N", CASES)
def test_the_product_uses_the_dropout_kernels_mask(x_shape, N, impl):
    """An identity weight gives the dropped x itself: bit for bit the dropout kernel's output."""
    K = x_shape[-1]
    x = jax.random.uniform(jax.random.key(1), x_shape, jnp.float32, 0.5, 2.0)
    out = dropout_linear.dropout_linear_forward(KEY, x, jnp.eye(K, dtype=jnp.float32), p=0.3, impl=impl,
                                                interpret=True)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(dropout.dropout(KEY, x, p=0.3, impl=impl,
                                                                              interpret=True)))


@covered_on_the_newest_jax
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("x_shape,N", CASES)
def test_values_and_gradients_are_the_unfused_ones(x_shape, N, impl, dtype):
    x, weight, grad_out = _case(x_shape, N, dtype)
    dropped = dropout.dropout(KEY, x, p=0.3, impl=impl, interpret=True)
    out = dropout_linear.dropout_linear_forward(KEY, x, weight, p=0.3, impl=impl, interpret=True)
    grad_x, grad_w = dropout_linear.dropout_linear_backward(KEY, x, weight, grad_out, p=0.3, impl=impl,
                                                            interpret=True)
    assert out.dtype == grad_x.dtype == dtype and out.shape == grad_out.shape and grad_x.shape == x.shape
    assert grad_w.dtype == jnp.float32 and grad_w.shape == weight.shape
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(_f64(out), _f64(dropped) @ _f64(weight).T, **tolerance)
    # x's gradient: dropout's backward of grad @ weight, rounded to the dtype as autograd does apart.
    grad_dropped = (_f64(grad_out) @ _f64(weight)).astype(np.float32)
    expected = dropout.dropout(KEY, jnp.asarray(grad_dropped).astype(dtype), p=0.3, impl=impl, interpret=True)
    np.testing.assert_allclose(_f64(grad_x), _f64(expected), **tolerance)
    assert np.array_equal(np.asarray(grad_x) == 0, np.asarray(expected) == 0)
    K, N = x_shape[-1], weight.shape[0]
    np.testing.assert_allclose(_f64(grad_w), _f64(grad_out).reshape(-1, N).T @ _f64(dropped).reshape(-1, K),
                               **tolerance)


def test_a_dropped_nan_gives_nan_as_torchs_dropout():
    x, weight, _ = _case((100, 1024), 16, jnp.float32)
    out = dropout_linear.dropout_linear_forward(KEY, x.at[0, :].set(jnp.nan), weight, p=0.5, interpret=True)
    assert np.isnan(np.asarray(out[0])).all() and not np.isnan(np.asarray(out[1:])).any()


def test_which_inputs_it_takes():
    assert dropout_linear.takes((4, 16, 1024), "tiled") and dropout_linear.takes((4, 16, 1000), "threefry")
    assert not dropout_linear.takes((4, 16, 1000), "tiled")  # seen lane-dense, not as its rows
    assert not dropout_linear.takes((32, 197, 768), "tiled")  # seen with its first two dims swapped
    assert not dropout_linear.takes((0, 1024), "tiled") and not dropout_linear.takes((2**22, 1025), "threefry")
    with pytest.raises(ValueError, match="share K"):
        dropout_linear.dropout_linear_forward(KEY, jnp.ones((8, 256)), jnp.ones((4, 128)), p=0.1, interpret=True)
    with pytest.raises(ValueError, match="run dropout and the product apart"):
        dropout_linear.dropout_linear_forward(KEY, jnp.ones((8, 100)), jnp.ones((4, 100)), p=0.1, impl="tiled",
                                              interpret=True)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_a_16_bit_x_with_a_float32_weight_is_x_widened(dtype):
    """PEFT's float32 adapters over a 16-bit model: the kernels read x and widen it, with the
    results of x.to(float32): the same output and weight gradient, x's gradient rounded once."""
    x, weight, grad_out = _case((100, 1024), 16, jnp.float32)
    narrow = x.astype(dtype)
    wide = narrow.astype(jnp.float32)
    out = dropout_linear.dropout_linear_forward(KEY, narrow, weight, p=0.3, interpret=True)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(
        dropout_linear.dropout_linear_forward(KEY, wide, weight, p=0.3, interpret=True)))
    grad_x, grad_w = dropout_linear.dropout_linear_backward(KEY, narrow, weight, grad_out, p=0.3, interpret=True)
    wide_grad_x, wide_grad_w = dropout_linear.dropout_linear_backward(KEY, wide, weight, grad_out, p=0.3,
                                                                      interpret=True)
    assert out.dtype == grad_w.dtype == jnp.float32 and grad_x.dtype == dtype
    np.testing.assert_array_equal(np.asarray(grad_x), np.asarray(wide_grad_x.astype(dtype)))
    np.testing.assert_array_equal(np.asarray(grad_w), np.asarray(wide_grad_w))
    with pytest.raises(TypeError, match="float32 for a 16-bit x"):
        dropout_linear.dropout_linear_forward(KEY, x, weight.astype(jnp.bfloat16), p=0.3, interpret=True)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_block_of_rows_gets_its_part_of_the_whole_mask(impl):
    """Rows from first_row on of a tensor of global_shape (a DTensor's shard): the whole call's
    rows bit for bit, the output and x's gradient, from a row the per-tile impls' tiles start
    at; a row inside a tile raises."""
    x, weight, grad_out = _case((4, 256, 128), 16, jnp.float32)
    rows, grads = x.reshape(-1, 128), grad_out.reshape(-1, 16)
    whole = dropout_linear.dropout_linear_forward(KEY, rows, weight, p=0.3, impl=impl, interpret=True)
    whole_grad_x, _ = dropout_linear.dropout_linear_backward(KEY, rows, weight, grads, p=0.3, impl=impl,
                                                             interpret=True)
    tile = dropout_linear.row_tile(x.shape, impl)
    assert tile == (512 if impl == "tiled" else 1)
    first, count = (512, 300) if impl == "tiled" else (37, 300)
    block = dict(global_shape=x.shape, first_row=first)
    out = dropout_linear.dropout_linear_forward(KEY, rows[first:first + count], weight, p=0.3, impl=impl,
                                                interpret=True, **block)
    grad_x, _ = dropout_linear.dropout_linear_backward(KEY, rows[first:first + count], weight,
                                                       grads[first:first + count], p=0.3, impl=impl, interpret=True,
                                                       **block)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(whole[first:first + count]))
    np.testing.assert_array_equal(np.asarray(grad_x), np.asarray(whole_grad_x[first:first + count]))
    if impl == "tiled":
        with pytest.raises(ValueError, match="takes_rows"):
            dropout_linear.dropout_linear_forward(KEY, rows[8:16], weight, p=0.3, impl=impl, interpret=True,
                                                  global_shape=x.shape, first_row=8)


@pytest.mark.parametrize("impl", IMPLS)
def test_the_backward_over_two_halves_of_the_rows_is_the_whole_ones(monkeypatch, impl):
    """The compiled kernels' layout, forced here (interpret mode takes every row in one block):
    four blocks of rows, two halves of them a parallel axis, each with its own sum of the
    weight's gradient, added after: x's gradient bit for bit, the weight's within rounding."""
    x, weight, grad_out = _case((1024, 256), 16, jnp.float32)
    whole = dropout_linear.dropout_linear_backward(KEY, x, weight, grad_out, p=0.3, impl=impl, interpret=True)
    layout = dropout_linear._layout
    monkeypatch.setattr(dropout_linear, "_layout", lambda *args: (256, *layout(*args)[1:]))
    halves = dropout_linear.dropout_linear_backward(KEY, x, weight, grad_out, p=0.3, impl=impl, interpret=True)
    np.testing.assert_array_equal(np.asarray(halves[0]), np.asarray(whole[0]))
    np.testing.assert_allclose(np.asarray(halves[1]), np.asarray(whole[1]), rtol=1e-5, atol=1e-4)
