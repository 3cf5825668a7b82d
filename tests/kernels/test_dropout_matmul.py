"""``dropout(weights) @ value`` in one kernel against float64 references given the same mask:
values and both gradients, across dtypes, batch ranks, lengths that are not block multiples and
blocks that differ between forward and backward, both noise impls (hardware emulated). The
threefry mask is jax.random's, so the dropout kernel's for the same key."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from jax._src import config as jax_config

from conftest import covered_on_the_newest_jax, crossed
from reference import attention_hardware_keep as hardware_keep, attention_threefry_keep as threefry_keep
from reference import key_data
from torch_pallas.kernels import attention, dropout, dropout_matmul, heads_in_lanes
from torch_pallas.kernels.attention import AttentionBlocks as Blocks

KEY = key_data(1234)


def _case(shape_w, Ev, dtype, seed=0):
    rng = np.random.default_rng(seed)
    weights = rng.random(shape_w).astype(np.float32)
    value = rng.standard_normal((*shape_w[:-2], shape_w[-1], Ev)).astype(np.float32)
    grad_out = rng.standard_normal((*shape_w[:-1], Ev)).astype(np.float32)
    return (jnp.asarray(weights, dtype), jnp.asarray(value, dtype), jnp.asarray(grad_out, dtype))


def _reference(weights, value, grad_out, keep, p):
    """Output and gradients in float64, the kept weights scaled by 1 / (1 - p)."""
    def product(w, v):
        return jnp.einsum("...ls,...sd->...ld", jnp.where(keep, w / (1 - p), 0.0), v)

    as64 = [np.asarray(x, np.float64) for x in (weights, value, grad_out)]
    out, vjp = jax.vjp(product, as64[0], as64[1])
    return (out, *vjp(as64[2]))


def _check(shape_w, Ev, *, p=0.25, dtype=jnp.float32, impl="threefry", blocks=None, backward_blocks=None, rtol=1e-5):
    weights, value, grad_out = _case(shape_w, Ev, dtype)
    keep = (threefry_keep if impl == "threefry" else hardware_keep)(shape_w, p)
    with jax_config.enable_x64(True):  # jax.experimental.enable_x64 is gone in jax 0.10
        expected = _reference(weights, value, grad_out, keep, p)
    out = dropout_matmul.dropout_matmul_forward(jnp.asarray(KEY), weights, value, p=p, impl=impl, interpret=True,
                                                blocks=blocks)
    grads = dropout_matmul.dropout_matmul_backward(jnp.asarray(KEY), weights, value, grad_out, p=p, impl=impl,
                                                   interpret=True, blocks=backward_blocks)
    assert out.dtype == dtype and out.shape == expected[0].shape
    for got, want, operand in zip((out, *grads), expected, (grad_out, weights, value)):
        assert got.shape == operand.shape and got.dtype == dtype
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=rtol, atol=rtol * 10)


@covered_on_the_newest_jax
@pytest.mark.parametrize("shape_w, Ev, blocks, backward_blocks", [
    ((1, 40, 300), 16, Blocks(16, 128), Blocks(8, 256)),        # lengths not block multiples (padded), differing
    ((2, 197, 197), 64, None, None),                            # ViT's lengths; default blocks
    ((2, 4, 16, 128), 32, None, None),                          # short planes: heads in lanes
])
def test_threefry_matches_the_reference(shape_w, Ev, blocks, backward_blocks):
    _check(shape_w, Ev, blocks=blocks, backward_blocks=backward_blocks)


@covered_on_the_newest_jax
@pytest.mark.parametrize("dtype, rtol", [(jnp.bfloat16, 2e-2), (jnp.float16, 2e-3)])
def test_16_bit_dtypes(dtype, rtol):
    _check((2, 32, 256), 64, dtype=dtype, rtol=rtol)


# Slow (./dev test --slow runs it): the per-tile mask forward and backward is in the default run with the
# tiled impl's bits (tests/kernels/test_tiled.py), the values and gradients with threefry's.
@pytest.mark.slow
def test_hardware_matches_the_reference_with_the_attention_kernels_mask(emulated_hardware_prng):
    _check((1, 264, 300), 16, impl="hardware", backward_blocks=Blocks(8, 512))
    _check((1, 40, 300), 16, impl="hardware", backward_blocks=Blocks(40, 128))  # one row of tiles


def test_the_threefry_mask_is_the_dropout_kernels():
    """Fused or not, the same weights are dropped: dropout's kernel then a product in float64."""
    weights, value, _ = _case((2, 48, 384), 8, jnp.float32, seed=3)
    dropped = dropout.dropout(jnp.asarray(KEY), weights, p=0.5, impl="threefry", interpret=True)
    out = dropout_matmul.dropout_matmul_forward(jnp.asarray(KEY), weights, value, p=0.5, impl="threefry",
                                                interpret=True, blocks=Blocks(16, 128))
    expected = np.einsum("bls,bsd->bld", np.asarray(dropped, np.float64), np.asarray(value, np.float64))
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=1e-5, atol=1e-5)


def test_a_dropped_nan_gives_nan_as_torchs_dropout():
    weights, value, grad_out = _case((1, 8, 128), 8, jnp.float32)
    weights = weights.at[0, 0, :].set(jnp.nan)
    out = dropout_matmul.dropout_matmul_forward(jnp.asarray(KEY), weights, value, p=0.5, interpret=True)
    assert np.isnan(np.asarray(out[0, 0])).all() and not np.isnan(np.asarray(out[0, 1:])).any()


@pytest.mark.parametrize("weights, value", [((2, 8, 16), (2, 16)), ((2, 8, 16), (3, 16, 4)), ((8, 16), (8, 4))])
def test_shapes_that_do_not_pair_are_rejected(weights, value):
    with pytest.raises(ValueError, match="share their batch dims and S"):
        dropout_matmul.dropout_matmul_forward(jnp.asarray(KEY), jnp.zeros(weights), jnp.zeros(value), p=0.1,
                                              interpret=True)


def _softmax_reference(scores, value, grad_out, keep, p):
    """dropout(softmax(scores)) @ value and its gradients in float64."""
    def product(s, v):
        return jnp.einsum("...ls,...sd->...ld", jnp.where(keep, jax.nn.softmax(s, axis=-1) / (1 - p), 0.0), v)

    as64 = [np.asarray(x, np.float64) for x in (scores, value, grad_out)]
    out, vjp = jax.vjp(product, as64[0], as64[1])
    return (out, *vjp(as64[2]))


@covered_on_the_newest_jax
@pytest.mark.parametrize("impl, shape_w, Ev, blocks", [
    ("threefry", (1, 40, 300), 16, Blocks(16, 300)),       # several row blocks, L not a multiple of them
    ("hardware", (1, 40, 300), 16, None),                  # a block of all of L and S: the last tiles' bits cut
    ("hardware", (1, 4, 24, 256), 64, None),               # short planes: heads in lanes, two a column
])
def test_softmax_first_matches_the_reference(impl, shape_w, Ev, blocks, request):
    if impl == "hardware":
        request.getfixturevalue("emulated_hardware_prng")
    scores, value, grad_out = _case(shape_w, Ev, jnp.float32, seed=2)
    scores = scores * 8 - 4
    keep = (threefry_keep if impl == "threefry" else hardware_keep)(shape_w, 0.25)
    with jax_config.enable_x64(True):
        expected = _softmax_reference(scores, value, grad_out, keep, 0.25)
    options = dict(p=0.25, impl=impl, interpret=True, blocks=blocks, softmax=True)
    out = dropout_matmul.dropout_matmul_forward(jnp.asarray(KEY), scores, value, **options)
    grads = dropout_matmul.dropout_matmul_backward(jnp.asarray(KEY), scores, value, grad_out, **options)
    for got, want in zip((out, *grads), expected):
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-5)


@covered_on_the_newest_jax
@pytest.mark.parametrize("softmax,impl", crossed({("weights", "tiled"), ("softmax", "threefry")},
                                                 softmax={"weights": False, "softmax": True},
                                                 impl=["threefry", "tiled"]))
def test_planes_per_grid_step_give_the_same_values_and_gradients(softmax, impl):
    """A grid step over several short planes draws each plane's own mask: values and both
    gradients are those of one plane per step, bit for bit."""
    weights, value, grad_out = _case((4, 24, 40), 16, jnp.float32, seed=3)
    results = []
    for planes in (1, 2, 4):
        options = dict(p=0.25, impl=impl, interpret=True, blocks=Blocks(24, 40, planes), softmax=softmax)
        out = dropout_matmul.dropout_matmul_forward(jnp.asarray(KEY), weights, value, **options)
        results.append((out, *dropout_matmul.dropout_matmul_backward(jnp.asarray(KEY), weights, value, grad_out,
                                                                     **options)))
    for other in results[1:]:
        for got, want in zip(other, results[0]):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_short_planes_share_a_grid_step_counting_the_weights_lanes():
    """ViT-B/16's 384 planes of 197 x 197 weights with 64-lane values: 4 per step, the weights'
    256 lanes and the value's 128 within attention's 8 x 256 lanes per row, as a mask's are
    counted; 512-lane values: 2."""
    problem = attention.weights_problem((384,), 197, 197, 64)
    assert attention.resolve_blocks(Blocks(197, 197), problem, impl="tiled", interpret=False).planes == 4
    wider = attention.weights_problem((384,), 197, 197, 512)
    assert attention.resolve_blocks(Blocks(197, 197), wider, impl="tiled", interpret=False).planes == 2


def test_softmax_first_needs_whole_rows_that_fit():
    with pytest.raises(ValueError, match="whole rows"):
        dropout_matmul.dropout_matmul_forward(jnp.asarray(KEY), jnp.zeros((2, 8, 256)), jnp.zeros((2, 256, 8)), p=0.1,
                                              interpret=True, blocks=Blocks(8, 128), softmax=True)
    assert dropout_matmul.rows_fit(8, 16384, "threefry") and not dropout_matmul.rows_fit(8, 16385, "threefry")
    # With the hardware PRNG a block holds at least its tiles' rows (or all of L): 197 rows (200-row
    # tiles) of 1024 scores fit, of 1025 not; GPT-2's 1024 x 1024 (256-row tiles) fit.
    assert dropout_matmul.rows_fit(197, 1024, "hardware") and not dropout_matmul.rows_fit(197, 1025, "hardware")
    assert dropout_matmul.rows_fit(1024, 1024, "hardware") and not dropout_matmul.rows_fit(1024, 1025, "hardware")
    with pytest.raises(ValueError, match="rows of at most 16384 scores"):
        dropout_matmul.dropout_matmul_forward(jnp.asarray(KEY), jnp.zeros((1, 8, 16385)), jnp.zeros((1, 16385, 8)),
                                              p=0.1, interpret=True, softmax=True)


@covered_on_the_newest_jax
def test_the_value_read_transposed_gives_the_same_results_to_rounding(monkeypatch):
    weights, value, grad_out = _case((3, 24, 40), 8, jnp.float32)  # (40, 8) value planes: read as (8, 40)
    problem = attention.weights_problem((3,), 24, 40, 8)
    assert attention.resolve_static(problem, None, dropout_p=0.25, impl="threefry", causal=False, scale=1.0,
                                    interpret=True, backward=False, global_shape=None).value_transposed

    def run():
        out = dropout_matmul.dropout_matmul_forward(jnp.asarray(KEY), weights, value, p=0.25, interpret=True)
        return out, dropout_matmul.dropout_matmul_backward(jnp.asarray(KEY), weights, value, grad_out, p=0.25,
                                                           interpret=True)

    transposed = run()
    monkeypatch.setattr(attention, "lanes_transposed", lambda rows, cols: False)
    for want, have in zip(jax.tree.leaves(transposed), jax.tree.leaves(run()), strict=True):
        # XLA's CPU dot may sum a transposed operand in another order (jax 0.10: last bits).
        np.testing.assert_allclose(np.asarray(have), np.asarray(want), rtol=1e-5, atol=1e-5)


# Every pair of the softmax and the impl; each layout with one or two of them.
@covered_on_the_newest_jax
@pytest.mark.parametrize("layout,softmax,impl", crossed(
    {("4-heads-a-column", "weights", "tiled"), ("4-heads-a-column", "softmax", "threefry"),
     ("2-heads-a-column", "weights", "threefry"), ("vit-197", "softmax", "tiled")},
    layout={"4-heads-a-column": ((2, 4, 16, 128), 32), "2-heads-a-column": ((1, 12, 24, 256), 64),
            "vit-197": ((1, 4, 197, 197), 64)},
    softmax={"weights": False, "softmax": True}, impl=["threefry", "tiled"]))
def test_heads_in_lanes_give_the_planes_kernels_values_and_gradients(layout, softmax, impl):
    """Short planes whose value a projection holds as ``(B, S, H * E)`` run on that layout, with
    the mask of the kernels over planes and their values and gradients to float32 rounding (the
    value's gradient sums over blocks of rows there; jax 0.10's CPU dot sums a transposed operand
    in another order). Another mask would be off by whole kept weights times values."""
    shape_w, Ev = layout
    assert heads_in_lanes.takes_weights(shape_w, (*shape_w[:-2], shape_w[-1], Ev), jnp.float32, blocks=None)
    weights, value, grad_out = _case(shape_w, Ev, jnp.float32, seed=4)
    results = []
    for blocks in (None, Blocks(8 if impl == "threefry" else shape_w[-2], shape_w[-1])):
        options = dict(p=0.25, impl=impl, interpret=True, blocks=blocks, softmax=softmax)
        results.append((dropout_matmul.dropout_matmul_forward(jnp.asarray(KEY), weights * 4, value, **options),
                        *dropout_matmul.dropout_matmul_backward(jnp.asarray(KEY), weights * 4, value, grad_out,
                                                                **options)))
    for lanes, planes in zip(*results, strict=True):
        np.testing.assert_allclose(np.asarray(lanes), np.asarray(planes), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("shape_w, Ev, blocks", [
    ((2, 4, 16, 128), 32, Blocks(16, 128)),   # blocks given
    ((8, 16, 128), 32, None),                 # no head dim
    ((2, 4, 264, 256), 32, None),             # L past 256
    ((2, 4, 16, 257), 32, None),              # S past 256
    ((2, 4, 16, 128), 48, None),              # a head dim that does not divide 128
    ((2, 3, 16, 128), 32, None),              # heads that do not fill whole columns
])
def test_heads_in_lanes_take_short_planes_of_whole_columns_only(shape_w, Ev, blocks):
    value_shape = (*shape_w[:-2], shape_w[-1], Ev)
    assert not heads_in_lanes.takes_weights(shape_w, value_shape, jnp.float32, blocks=blocks)


@covered_on_the_newest_jax
@pytest.mark.parametrize("shape_w, blocks, impl", [
    ((2, 3, 24, 40), None, "tiled"),          # short planes: whole planes, several per grid step
    ((1, 40, 300), Blocks(40, 256), "tiled"),  # lengths not block multiples (padded), other blocks
    ((600, 72), None, "threefry"),            # one plane, no batch dims
])
def test_the_weights_dropped_alone_are_the_ones_the_product_multiplies(shape_w, blocks, impl):
    """dropout_weights: bit for bit what dropout_matmul_forward multiplies by the value (its product
    with an identity is exact), whatever its blocks; float16 as float32's, rounded."""
    weights, _, _ = _case(shape_w, 8, jnp.float32, seed=4)
    identity = jnp.broadcast_to(jnp.eye(shape_w[-1], dtype=jnp.float32), (*shape_w[:-2], shape_w[-1], shape_w[-1]))
    product = dropout_matmul.dropout_matmul_forward(jnp.asarray(KEY), weights, identity, p=0.3, impl=impl,
                                                    interpret=True)
    alone = dropout_matmul.dropout_weights(jnp.asarray(KEY), weights, p=0.3, impl=impl, interpret=True, blocks=blocks)
    assert alone.shape == weights.shape and alone.dtype == weights.dtype
    np.testing.assert_array_equal(np.asarray(alone), np.asarray(product))
    half = dropout_matmul.dropout_weights(jnp.asarray(KEY), weights.astype(jnp.float16), p=0.3, impl=impl,
                                          interpret=True)
    assert half.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(half) != 0, np.asarray(alone) != 0)


def test_the_weights_of_a_block_of_planes_are_their_part_of_the_whole():
    """A DTensor's shard of planes (global_shape, its first plane's [high, low] words): its part of
    the whole tensor's dropped weights."""
    weights, _, _ = _case((2, 4, 16, 128), 8, jnp.float32, seed=5)
    whole = dropout_matmul.dropout_weights(jnp.asarray(KEY), weights, p=0.3, impl="tiled", interpret=True)
    for b, heads in ((0, slice(2, 4)), (1, slice(0, 2))):
        got = dropout_matmul.dropout_weights(jnp.asarray(KEY), weights[b, heads], p=0.3, impl="tiled",
                                             interpret=True, global_shape=(8, 16, 128),
                                             shard_offset=jnp.asarray([0, b * 4 + heads.start], jnp.int32))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(whole[b, heads]))
