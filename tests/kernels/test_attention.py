"""The flash-attention kernels against a float64 reference given the same dropout mask: values
and the gradients of query, key, value (and a float mask), across causal, boolean and float
masks, GQA, broadcast batch dims, L != S, lengths that are not block multiples, head dims 64,
128 and an odd one, both noise impls (hardware emulated), and backward blocks forced to
differ from the forward's. The threefry mask is checked bit for bit against jax.random."""

import functools

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from jax._src import config as jax_config

from conftest import covered_on_the_newest_jax, crossed
from reference import attention_hardware_keep as hardware_keep, attention_threefry_keep as threefry_keep
from reference import jax_key, jax_random_part, key_data
from torch_pallas.kernels import attention, dropout_matmul, heads_in_lanes
from torch_pallas.kernels.attention import AttentionBlocks as Blocks

KEY = key_data(1234)


def reference(query, key, value, bias, keep, *, dropout_p, causal, scale, gqa):
    """Attention in float64 with the given keep mask (None: no dropout); differentiable."""
    query, key, value = (x.astype(jnp.float64) for x in (query, key, value))
    if gqa:
        group = query.shape[-3] // key.shape[-3]
        key, value = (jnp.repeat(x, group, axis=-3) for x in (key, value))
    scores = jnp.einsum("...le,...se->...ls", query, key) * scale
    L, S = scores.shape[-2:]
    if bias is not None:
        scores = scores + (jnp.where(bias, 0.0, -jnp.inf) if bias.dtype == jnp.bool_ else bias.astype(jnp.float64))
    if causal:
        scores = jnp.where(jnp.tril(jnp.ones((L, S), bool)), scores, -jnp.inf)
    top = jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.exp(scores - jnp.where(jnp.isinf(top), 0.0, jax.lax.stop_gradient(top)))
    total = jnp.sum(weights, axis=-1, keepdims=True)
    weights = jnp.where(total == 0, 0.0, weights / jnp.where(total == 0, 1.0, total))  # torch's safe softmax
    if keep is not None:
        weights = weights * np.where(keep, 1 / (1 - dropout_p) if dropout_p < 1 else 0.0, 0.0)
    return jnp.einsum("...ls,...sd->...ld", weights, value)


def check(query_shape, key_shape, value_shape, *, bias=None, dropout_p=0.0, impl="threefry", causal=False,
          gqa=False, blocks=None, backward_blocks=None, dtype=jnp.float32, scale=None, seed=0):
    rng = np.random.default_rng(seed)
    query, key, value = (jnp.asarray(rng.standard_normal(shape), dtype) for shape in (query_shape, key_shape, value_shape))
    options = dict(dropout_p=dropout_p, impl=impl, causal=causal, scale=scale, gqa=gqa, interpret=True,
                   blocks=blocks, backward_blocks=backward_blocks)
    float_bias = bias is not None and bias.dtype != jnp.bool_
    grad_out = jnp.asarray(rng.standard_normal((*query.shape[:-1], value.shape[-1])), dtype)

    @jax.jit
    def forward_and_backward(query, key, value, float_bias_or_none):
        # One compile for the forward and both backward kernels.
        def function(*operands):
            return attention.attention(jnp.asarray(KEY), *operands[:3], operands[3] if float_bias else bias, **options)
        out, pullback = jax.vjp(function, query, key, value, float_bias_or_none)
        return out, pullback(grad_out)

    out, grads = forward_and_backward(query, key, value, bias if float_bias else None)
    grads = grads[:4] if float_bias else grads[:3]
    problem = attention.resolve_problem(query.shape, key.shape, value.shape, None if bias is None else bias.shape,
                                        gqa=gqa)
    weights_shape = (*problem.batch, problem.L, problem.S)
    keep = None if not dropout_p else (threefry_keep if impl == "threefry" else hardware_keep)(weights_shape, dropout_p)
    with jax_config.enable_x64(True):  # jax.experimental.enable_x64 is gone in jax 0.10
        operands = [np.asarray(x, np.float64) for x in (query, key, value)]
        reference_bias = None if bias is None else (bias if not float_bias else np.asarray(bias, np.float64))
        function = functools.partial(reference, keep=keep, dropout_p=dropout_p, causal=causal, gqa=gqa,
                                     scale=1 / np.sqrt(problem.E) if scale is None else scale)
        # One compile for the reference and its gradients (op by op, each op compiles for its shapes).
        expected, pullback = jax.jit(lambda *args: jax.vjp(function, *args))(*operands, reference_bias)
        expected_grads = jax.jit(pullback)(np.asarray(grad_out, np.float64))[:4 if float_bias else 3]
        expected, expected_grads = np.asarray(expected), [np.asarray(g) for g in expected_grads]
    tolerance = 2e-5 if dtype == jnp.float32 else 3e-2
    assert out.shape == expected.shape and out.dtype == dtype
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, atol=tolerance, rtol=tolerance)
    for grad, expected_grad in zip(grads, expected_grads):
        assert grad.shape == expected_grad.shape
        scale_of = max(1.0, float(np.abs(expected_grad).max()))
        np.testing.assert_allclose(np.asarray(grad, np.float64), expected_grad, atol=tolerance * scale_of,
                                   rtol=tolerance)
    return out, grads


# (query, key, value shapes, options); where blocks are forced, the backward's differ from the forward's.
CASES = {
    # L != S, neither a block multiple; several blocks each way, causal blocks skipped.
    "ragged-causal": ((2, 3, 40, 64), (2, 3, 300, 64), (2, 3, 300, 64),
                      dict(causal=True, dropout_p=0.3, blocks=Blocks(16, 128), backward_blocks=Blocks(8, 256))),
    # One block of every key forward (no running statistics); one block of rows backward, whose
    # key blocks past the last row are skipped and their gradients zero.
    "causal-whole-rows-forward-whole-columns-backward": (
        (2, 3, 40, 64), (2, 3, 300, 64), (2, 3, 300, 64),
        dict(causal=True, dropout_p=0.3, blocks=Blocks(16, 300), backward_blocks=Blocks(40, 128))),
    # L > S causal (rows past S see every key), GQA, key and value broadcast over the batch.
    "gqa-broadcast-causal": ((2, 4, 72, 64), (1, 2, 24, 64), (1, 2, 24, 64), dict(causal=True, gqa=True, dropout_p=0.2)),
    "head-dim-128-value-64": ((2, 2, 32, 128), (2, 2, 160, 128), (2, 2, 160, 64),
                              dict(dropout_p=0.1, blocks=Blocks(32, 128), backward_blocks=Blocks(8, 160))),
    "odd-head-dim-unbatched": ((17, 33), (29, 33), (29, 7), dict(dropout_p=0.5, scale=0.3)),
    "no-dropout": ((2, 3, 40, 64), (2, 3, 50, 64), (2, 3, 50, 32), dict()),
    "dropout-1": ((1, 2, 16, 16), (1, 2, 16, 16), (1, 2, 16, 16), dict(dropout_p=1.0)),
    # heads_in_lanes: two heads per 128-lane column, causal; four per column over two columns of keys.
    "heads-in-lanes-causal": ((2, 4, 128, 64), (2, 4, 128, 64), (2, 4, 128, 64), dict(causal=True, dropout_p=0.2)),
    "heads-in-lanes-32": ((1, 8, 24, 32), (1, 8, 256, 32), (1, 8, 256, 32), dict(dropout_p=0.3)),
    # A boolean mask per row, the same for every head (batch 1's last 28 keys padding, its row 5
    # with nothing to attend to); a float mask per row, broadcast over the batch, whose gradient
    # the flash kernels give (the forward's log-sum-exp is theirs).
    "heads-in-lanes-padding-mask": ((2, 4, 64, 64), (2, 4, 128, 64), (2, 4, 128, 64),
                                    dict(bias=jnp.asarray((np.arange(128) < [[[[128]]], [[[100]]]])
                                                          & (np.arange(64)[:, None] != [[[[-1]]], [[[5]]]])),
                                         dropout_p=0.2)),
    "heads-in-lanes-float-mask": ((2, 2, 64, 64), (2, 2, 128, 64), (2, 2, 128, 64),
                                  dict(bias=jnp.asarray(np.random.default_rng(5).standard_normal((1, 1, 64, 128)),
                                                        jnp.float32), dropout_p=0.1)),
}


@covered_on_the_newest_jax
@pytest.mark.parametrize("case", CASES)
def test_matches_float64_reference_with_the_same_mask(case):
    query, key, value, options = CASES[case]
    check(query, key, value, **options)


def test_boolean_mask_broadcast_with_a_fully_masked_row_gives_zeros():
    rng = np.random.default_rng(1)
    mask = rng.random((2, 1, 40, 50)) > 0.3
    mask[:, :, 3] = False  # a row with nothing to attend to: zeros, forward and backward (torch's safe softmax)
    out, (grad_query, grad_key, grad_value) = check((2, 3, 40, 16), (2, 3, 50, 16), (2, 3, 50, 16),
                                                    bias=jnp.asarray(mask), dropout_p=0.2)
    assert not np.asarray(out[:, :, 3]).any() and not np.asarray(grad_query[:, :, 3]).any()
    assert np.isfinite(np.asarray(grad_key)).all() and np.isfinite(np.asarray(grad_value)).all()


# Every key in one backward block (the key-value kernel gives the query's and the mask's gradients
# too), and keys over two blocks (the query kernel gives them).
@covered_on_the_newest_jax
@pytest.mark.parametrize("bias_shape, backward_blocks", [((1, 3, 24, 40), Blocks(8, 40)),
                                                         ((2, 1, 1, 256), Blocks(8, 128))],
                         ids=["one-key-block", "two-key-blocks"])
def test_float_mask_gets_its_gradient_summed_to_its_shape(bias_shape, backward_blocks):
    bias = jnp.asarray(np.random.default_rng(2).standard_normal(bias_shape), jnp.float32)
    S = bias_shape[-1]
    check((2, 3, 24, 16), (2, 3, S, 16), (2, 3, S, 16), bias=bias, dropout_p=0.1, backward_blocks=backward_blocks)


@covered_on_the_newest_jax
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_16_bit_inputs(dtype):  # float16 is computed as float32 (Mosaic has no float16)
    check((2, 2, 24, 64), (2, 2, 40, 64), (2, 2, 40, 64), dropout_p=0.1, causal=True, dtype=dtype)


@pytest.mark.parametrize("blocks", [Blocks(8, 128), Blocks(48, 256)])
def test_threefry_mask_is_jax_bernoulli_whatever_the_blocks(blocks):
    """With equal scores every weight is 1/S: the output against an identity value is the mask."""
    B, L, S = 2, 48, 256
    value = jnp.broadcast_to(jnp.eye(S, dtype=jnp.float32), (B, S, S))
    out, _ = attention.attention_forward(jnp.asarray(KEY), jnp.zeros((B, L, 8)), jnp.zeros((B, S, 8)), value,
                                         dropout_p=0.3, impl="threefry", interpret=True, blocks=blocks)
    np.testing.assert_array_equal(np.asarray(out) > 0, threefry_keep((B, L, S), 0.3))


def test_hardware_mask_is_the_same_for_every_block_of_whole_tiles(emulated_hardware_prng):
    B, L, S = 2, 64, 1024
    tile = attention.attention_tile(L, S)
    assert tile == (64, 512)
    value = jnp.broadcast_to(jnp.eye(S, dtype=jnp.float32), (B, S, S))
    masks = [np.asarray(attention.attention_forward(jnp.asarray(KEY), jnp.zeros((B, L, 8)), jnp.zeros((B, S, 8)),
                                                    value, dropout_p=0.3, impl="hardware", interpret=True,
                                                    blocks=blocks)[0]) > 0
             for blocks in (Blocks(64, 512), Blocks(64, 1024))]
    np.testing.assert_array_equal(masks[0], masks[1])
    np.testing.assert_array_equal(masks[0], hardware_keep((B, L, S), 0.3))


# Slow (./dev test --slow runs it): the per-tile path with differing blocks is in the default run with the
# tiled impl's bits (tests/kernels/test_tiled.py), the values and gradients with threefry's.
@pytest.mark.slow
def test_hardware_forward_and_backward_with_different_blocks_match_the_reference(emulated_hardware_prng):
    assert attention.attention_tile(264, 300) == (8, 128)
    check((1, 2, 264, 16), (1, 2, 300, 16), (1, 2, 300, 16), dropout_p=0.2, impl="hardware",
          blocks=Blocks(264, 384), backward_blocks=Blocks(16, 128))


@pytest.mark.parametrize("L, S, tile", [(40, 300, (40, 128)), (197, 197, (200, 256)), (256, 300, (256, 128)),
                                        (264, 300, (8, 128)), (272, 300, (16, 128)), (1000, 1000, (8, 512)),
                                        (2048, 2048, (256, 512))])
def test_hardware_tile_has_every_row_of_a_short_plane(L, S, tile):
    """Each seed costs the same whatever its tile's size: a plane of at most 256 rows (in whole
    8-row sublanes) is one row of tiles; a longer one has as many rows per tile, up to 256, as
    divide it."""
    assert attention.attention_tile(L, S) == tile


def test_hardware_mask_of_a_short_plane_matches_the_reference(emulated_hardware_prng):
    """ViT-B/16's 197 patches: one 200-row tile per column of tiles, drawn whole and cut to L."""
    check((1, 2, 197, 16), (1, 2, 300, 16), (1, 2, 300, 16), dropout_p=0.2, impl="hardware",
          blocks=Blocks(197, 384), backward_blocks=Blocks(197, 128))


def test_hardware_default_blocks_take_a_short_length_whole():
    """ViT-B/16's 197 patches: every kernel's default block is all of L and S (its last seed
    tiles drawn whole and cut, as the reference above), so no operand is copied padded to
    (200, 256) tiles; a longer length keeps whole tiles."""
    short = attention.resolve_problem((2, 197, 64), (2, 197, 64), (2, 197, 64))
    long = attention.resolve_problem((2, 1000, 64), (2, 1000, 64), (2, 1000, 64))
    for backward in (False, True):
        assert attention.resolve_blocks(None, short, impl="hardware", interpret=False,
                                        backward=backward) == Blocks(197, 197, 2)
        assert attention.resolve_blocks(None, long, impl="hardware", interpret=False,
                                        backward=backward) == Blocks(256 if backward else 512, 512, 1)
    assert dropout_matmul._row_blocks(197, 197, "hardware") == Blocks(197, 197)


def test_hardware_blocks_must_be_whole_tiles(emulated_hardware_prng):
    with pytest.raises(ValueError, match="whole .* tiles"):
        attention.attention_forward(jnp.asarray(KEY), jnp.zeros((1, 64, 8)), jnp.zeros((1, 1024, 8)),
                                    jnp.zeros((1, 1024, 8)), dropout_p=0.1, impl="hardware", interpret=True,
                                    blocks=Blocks(64, 256))


def test_short_planes_share_a_grid_step():
    """ViT-B/16 (32 images x 12 heads of 197 x 197): a block of a whole plane of at most 256 x 256
    shares its step with as many planes, up to MAX_PLANES, as fit 8 x 256 lanes per row and
    divide the batch, in every kernel; a longer plane takes a step per block."""
    vit = attention.resolve_problem((32, 12, 197, 64), (32, 12, 197, 64), (32, 12, 197, 64))
    for impl in ("threefry", "hardware"):
        for backward in (False, True):
            assert attention.resolve_blocks(None, vit, impl=impl, interpret=False,
                                            backward=backward) == Blocks(197, 197, 8)
    assert attention.resolve_blocks(Blocks(197, 197), vit, impl="threefry", interpret=False,
                                    max_planes=1) == Blocks(197, 197, 1)
    odd = attention.resolve_problem((14, 197, 64), (14, 200, 64), (14, 200, 64))
    assert attention.resolve_blocks(None, odd, impl="threefry", interpret=False).planes == 7
    wider = attention.resolve_problem((14, 197, 64), (14, 300, 64), (14, 300, 64))
    assert attention.resolve_blocks(None, wider, impl="threefry", interpret=False).planes == 1
    wide = attention.resolve_problem((32, 12, 197, 256), (32, 12, 197, 256), (32, 12, 197, 256))
    masked = attention.resolve_problem((32, 12, 197, 128), (32, 12, 197, 128), (32, 12, 197, 128), (197, 197))
    assert attention.resolve_blocks(None, wide, impl="hardware", interpret=False).planes == 4
    assert attention.resolve_blocks(None, masked, impl="hardware", interpret=False).planes == 4
    bert = attention.resolve_problem((8, 12, 512, 64), (8, 12, 512, 64), (8, 12, 512, 64), (8, 1, 1, 512))
    assert attention.resolve_blocks(None, bert, impl="threefry", interpret=False).planes == 1


def test_heads_share_lanes_for_short_planes_only():
    """A transformers model's attention over at most 256 tokens (BERT's 128, ViT's 197; default
    blocks; a padding or causal mask, the same for every head, without its gradient) runs on the
    operands as its projections hold them; anything else runs the flash kernels."""
    bert = (8, 12, 128, 64)
    options = dict(bias=None, gqa=False, blocks=None, global_shape=None, causal=False)
    assert heads_in_lanes.takes(bert, bert, bert, **options)
    assert heads_in_lanes.takes(bert, bert, bert, **dict(options, causal=True))
    assert heads_in_lanes.takes((2, 8, 24, 32), (2, 8, 256, 32), (2, 8, 256, 32), **options)
    assert heads_in_lanes.takes(*((32, 12, 197, 64),) * 3, **options)
    assert heads_in_lanes.takes((2, 4, 5, 64), (2, 4, 37, 64), (2, 4, 37, 64), **options)
    for mask in (jnp.zeros((8, 1, 1, 128), bool), jnp.zeros((128, 128)), jnp.zeros((1, 1, 128, 128))):
        assert heads_in_lanes.takes(bert, bert, bert, **dict(options, bias=mask))
    for changed in (dict(bias=jnp.zeros((8, 12, 128, 128))), dict(bias=jnp.zeros((8, 1, 128, 1))),
                    dict(bias=jnp.zeros((128, 128)), bias_grad=True), dict(gqa=True), dict(blocks=Blocks(128, 128)),
                    dict(global_shape=(16, 12, 1, 1))):
        assert not heads_in_lanes.takes(bert, bert, bert, **dict(options, **changed))
    for query, key, value in [((8, 12, 257, 64),) * 3, ((8, 12, 512, 64),) * 3, ((8, 12, 128, 96),) * 3,
                              ((8, 3, 128, 64),) * 3, ((8, 12, 128, 64), (8, 12, 128, 64), (8, 12, 128, 32)),
                              ((8, 12, 128, 64), (1, 12, 128, 64), (1, 12, 128, 64)), ((12, 128, 64),) * 3]:
        assert not heads_in_lanes.takes(query, key, value, **options)
    assert not heads_in_lanes.takes((8, 12, 64, 64), bert, bert, **dict(options, causal=True))


# Each layout with one impl, each impl once: a layout's tiles and an impl's noise are separate parts.
@covered_on_the_newest_jax
@pytest.mark.parametrize("shape,impl", crossed(
    {("whole-tiles", "hardware"), ("vit-197", "tiled"), ("ragged", "threefry")},
    shape={"whole-tiles": ((2, 4, 64, 64), (2, 4, 128, 64)), "vit-197": ((1, 4, 197, 64), (1, 4, 197, 64)),
           "ragged": ((2, 4, 5, 64), (2, 4, 37, 64))},
    impl=["threefry", "tiled", "hardware"]))
def test_heads_in_lanes_give_the_flash_kernels_values_and_gradients(shape, impl, emulated_hardware_prng):
    """The same mask (plane ``b * H + h``, the whole plane's tiles, cut where the lengths are not
    whole tiles) and, to rounding, the same values and gradients as the flash kernels on the
    heads' planes."""
    rng = np.random.default_rng(4)
    query, key, value = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in (shape[0], shape[1], shape[1]))
    grad_out = jnp.asarray(rng.standard_normal(shape[0]), jnp.float32)
    assert heads_in_lanes.takes(*shape, shape[1], bias=None, gqa=False, blocks=None, global_shape=None, causal=False)
    results = []
    for blocks in (None, Blocks(shape[0][2], shape[1][2])):
        function = functools.partial(attention.attention, jnp.asarray(KEY), bias=None, dropout_p=0.3, impl=impl,
                                     interpret=True, blocks=blocks, backward_blocks=blocks)
        out, pullback = jax.vjp(function, query, key, value)
        results.append((out, *pullback(grad_out)))
    for in_lanes, flash in zip(*results):
        np.testing.assert_allclose(np.asarray(in_lanes), np.asarray(flash), rtol=1e-6, atol=1e-6)


def assert_bit_equal(expected, got):
    """``check``'s (output, gradients) of two runs, bit for bit."""
    for want, have in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(np.asarray(have), np.asarray(want))


@covered_on_the_newest_jax
@pytest.mark.parametrize("operands, planes", [
    # a float mask per head, broadcast over the batch: a block of mask planes per step
    (((2, 4, 24, 16), (2, 4, 24, 16), jnp.float32, (4, 24, 24), {}), 4),
    # a padding mask broadcast over heads: one mask plane shared by a step's planes
    (((2, 4, 24, 16), (2, 4, 24, 16), jnp.bool_, (2, 1, 1, 24), dict(causal=False)), 4),
    # GQA groups of two heads: one key and value plane per step
    (((2, 4, 24, 16), (2, 2, 24, 16), None, None, dict(gqa=True, causal=True)), 2),
], ids=["mask-per-head", "mask-over-heads", "gqa"])
def test_planes_per_step_give_the_same_values_and_gradients(operands, planes):
    query_shape, key_shape, bias_dtype, bias_shape, options = operands
    rng = np.random.default_rng(3)
    bias = None
    if bias_dtype is not None:
        bias = jnp.asarray(rng.standard_normal(bias_shape) > -1 if bias_dtype == jnp.bool_
                           else rng.standard_normal(bias_shape), bias_dtype)
    assert_bit_equal(*[check(query_shape, key_shape, key_shape, bias=bias, dropout_p=0.3, **options,
                             blocks=Blocks(24, 24, n), backward_blocks=Blocks(24, 24, n)) for n in (1, planes)])


def _static(query_shape, key_shape, blocks, interpret=False):
    problem = attention.resolve_problem(query_shape, key_shape, key_shape)
    return attention.resolve_static(problem, blocks, dropout_p=0.1, impl="threefry", causal=False, scale=1.0,
                                    interpret=interpret, backward=False, global_shape=None)


def test_key_and_value_are_read_transposed_where_one_block_holds_every_key_and_that_takes_fewer_bytes():
    # (rows, cols) planes in HBM's (8, 128) tiles: a head dim of 64 takes 128 lanes per row.
    assert attention.lanes_transposed(197, 64) and attention.lanes_transposed(1024, 64)
    assert not attention.lanes_transposed(197, 128) and not attention.lanes_transposed(1024, 256)
    vit, bert = _static((384, 197, 64), (384, 197, 64), None), _static((96, 512, 64), (96, 512, 64), None)
    assert vit.key_transposed and vit.value_transposed and bert.key_transposed and bert.value_transposed
    gpt2 = _static((96, 1024, 64), (96, 1024, 64), None)  # two blocks of keys
    assert gpt2.blocks.kv < 1024 and not gpt2.key_transposed and not gpt2.value_transposed
    assert not _static((24, 197, 128), (24, 197, 128), None).key_transposed


@covered_on_the_newest_jax
def test_key_and_value_read_transposed_give_the_same_values_and_gradients_to_rounding(monkeypatch):
    shapes = ((2, 3, 24, 16), (2, 3, 40, 16), (2, 3, 40, 8))  # key (40, 16) and value (40, 8) planes
    assert _static(shapes[0], shapes[1], None, interpret=True).key_transposed
    transposed = check(*shapes, dropout_p=0.3, causal=True)
    monkeypatch.setattr(attention, "lanes_transposed", lambda rows, cols: False)
    # The same mask and products; XLA's CPU dot may sum a transposed operand in another order
    # (jax 0.10: last-bit differences), so to float32 rounding.
    for want, have in zip(jax.tree.leaves(transposed), jax.tree.leaves(check(*shapes, dropout_p=0.3, causal=True)),
                          strict=True):
        np.testing.assert_allclose(np.asarray(have), np.asarray(want), rtol=1e-5, atol=1e-5)


@covered_on_the_newest_jax
def test_hardware_mask_is_the_same_for_any_planes_per_step(emulated_hardware_prng):
    assert_bit_equal(*[check((1, 4, 40, 16), (1, 4, 40, 16), (1, 4, 40, 16), dropout_p=0.2, impl="hardware",
                             blocks=Blocks(40, 40, n), backward_blocks=Blocks(40, 40, 2)) for n in (1, 4)])


@pytest.mark.parametrize("shapes, planes", [
    (((2, 3, 8, 4), (2, 3, 8, 4)), 4),  # does not divide the 6 planes
    (((2, 4, 8, 4), (2, 2, 8, 4)), 4),  # GQA groups of 2 heads: a step would read two partial groups
    (((4, 16, 8, 4), (4, 16, 8, 4)), attention.MAX_PLANES * 2),
])
def test_planes_that_do_not_group_are_rejected(shapes, planes):
    query_shape, key_shape = shapes
    with pytest.raises(ValueError, match="blocks.planes"):
        attention.attention_forward(jnp.asarray(KEY), jnp.zeros(query_shape), jnp.zeros(key_shape),
                                    jnp.zeros(key_shape), gqa=True, interpret=True, blocks=Blocks(8, 8, planes))


@pytest.mark.parametrize("shapes, match", [
    (((2, 8, 4), (2, 8, 5), (2, 8, 4)), "same last dim"),
    (((2, 8, 4), (2, 8, 4), (2, 9, 4)), "every dim but the last"),
    (((3, 8, 4), (2, 8, 4), (2, 8, 4)), "do not broadcast"),
    (((2, 3, 8, 4), (2, 2, 8, 4), (2, 2, 8, 4)), "do not broadcast"),
    (((8,), (8, 4), (8, 4)), "at least 2 dims"),
])
def test_shapes_torch_rejects_are_rejected(shapes, match):
    with pytest.raises(ValueError, match=match):
        attention.resolve_problem(*shapes)


def test_gqa_heads_must_divide_and_masks_must_broadcast():
    with pytest.raises(ValueError, match="multiple"):
        attention.resolve_problem((2, 6, 8, 4), (2, 4, 8, 4), (2, 4, 8, 4), gqa=True)
    with pytest.raises(ValueError, match="does not broadcast"):
        attention.resolve_problem((2, 6, 8, 4), (2, 6, 9, 4), (2, 6, 9, 4), (8, 8))


def test_blocks_mosaic_rejects_are_rejected_everywhere():
    with pytest.raises(ValueError, match="rejected by Mosaic"):
        attention.attention_forward(jnp.asarray(KEY), jnp.zeros((1, 64, 8)), jnp.zeros((1, 512, 8)),
                                    jnp.zeros((1, 512, 8)), interpret=True, blocks=Blocks(12, 128))
    with pytest.raises(TypeError, match="AttentionBlocks"):
        attention.attention_forward(jnp.asarray(KEY), jnp.zeros((1, 64, 8)), jnp.zeros((1, 512, 8)),
                                    jnp.zeros((1, 512, 8)), interpret=True, blocks=(8, 128))


@covered_on_the_newest_jax
@pytest.mark.parametrize("impl", ["threefry", "hardware"])
def test_a_shard_draws_its_part_of_the_whole_tensors_mask(impl, emulated_hardware_prng):
    """SPMD: a shard split over batch dims (here batch 1 of 2, heads 2-3 of 4) gets the flat
    batch index of its first plane as data and draws the whole tensor's mask there."""
    rng = np.random.default_rng(3)
    query, key, value = (jnp.asarray(rng.standard_normal((2, 4, 16, 8)), jnp.float32) for _ in range(3))
    options = dict(dropout_p=0.4, impl=impl, causal=True, interpret=True)
    whole, _ = attention.attention_forward(jnp.asarray(KEY), query, key, value, **options)
    part = (slice(1, 2), slice(2, 4))
    shard, lse = attention.attention_forward(jnp.asarray(KEY), query[part], key[part], value[part], **options,
                                             global_shape=(2, 4, 1, 1), shard_offset=np.array([0, 6], np.int32))
    np.testing.assert_array_equal(np.asarray(shard), np.asarray(whole[part]))
    if impl == "threefry":  # the backward kernels read the shard's place as the forward does
        grads = attention.attention_backward(jnp.asarray(KEY), query[part], key[part], value[part], shard, lse,
                                             jnp.ones_like(shard), **options, global_shape=(2, 4, 1, 1),
                                             shard_offset=np.array([0, 6], np.int32))
        whole_grads = jax.grad(lambda q, k, v: attention.attention(jnp.asarray(KEY), q, k, v, None, **options).sum(),
                               argnums=(0, 1, 2))(query, key, value)
        for grad, whole_grad in zip(grads, whole_grads):
            np.testing.assert_allclose(np.asarray(grad), np.asarray(whole_grad[part]), atol=1e-6, rtol=1e-6)


def test_a_shard_past_2_32_weights_draws_jax_randoms_bits():
    """Weights of 2**32 elements and more: threefry counters in two words. A shard of two
    128 x 128 planes across the 2**32-th weight (plane 262144) of a (300000, 128, 128) batch."""
    B, L, S = 300000, 128, 128
    first = 2**32 // (L * S) - 1
    value = jnp.broadcast_to(jnp.eye(S, dtype=jnp.float32), (2, S, S))
    out, _ = attention.attention_forward(jnp.asarray(KEY), jnp.zeros((2, L, 8)), jnp.zeros((2, S, 8)), value,
                                         dropout_p=0.3, impl="threefry", interpret=True, global_shape=(B, 1, 1),
                                         shard_offset=np.array([0, first], np.int32))
    expected = jax_random_part(lambda k: jax.random.bernoulli(k, np.float32(0.7), (B, L, S)), jax_key(1234),
                               (slice(first, first + 2),))
    np.testing.assert_array_equal(np.asarray(out) > 0, expected)
