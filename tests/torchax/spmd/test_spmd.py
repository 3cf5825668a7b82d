"""torchax tensors whose arrays are sharded over a JAX mesh of 4 CPU devices; run by
tests/torchax/test_sharding.py in a process of its own (XLA's host device count is fixed when
JAX starts), with XLA dumping every compiled module so the tests can read the partitioned HLO.

Each op on a sharded array runs its kernel per shard under jax.shard_map: the result equals
the unsharded call's bit for bit (the noise of each element's index in the whole tensor),
keeps the input's sharding, and nothing gathers the activations."""

import jax
import numpy as np
import pytest
import torch
import torchax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import hlo_dump
import torch_pallas
from attention_cases import sharded_case
from reference import keep_probability
from sampling_cases import sharded_logits_case

ENV = torchax.default_env()
MESHES = {"4x1": (4, 1), "1x4": (1, 4), "2x2": (2, 2)}

assert jax.device_count() == 4, "run with XLA_FLAGS=--xla_force_host_platform_device_count=4"


def mesh_of(name):
    return Mesh(np.array(jax.devices()).reshape(MESHES[name]), ("data", "model"))


def on_jax(tensor, mesh=None, spec=None):
    """A torchax tensor of ``tensor``'s values, its array sharded as ``spec`` says over ``mesh``."""
    with ENV:
        moved = tensor.to("jax")
    if mesh is None:
        return moved
    return torchax.tensor.Tensor(jax.device_put(moved._elem, NamedSharding(mesh, PartitionSpec(*spec))), ENV)


def array(tensor):
    return tensor.detach()._elem


def same_sharding(tensor, like):
    return array(tensor).sharding.is_equivalent_to(array(like).sharding, array(like).ndim)


def bits(tensor):
    return np.asarray(array(tensor)).view(np.uint8)


def compiled_modules(run):
    """:func:`hlo_dump.compiled_modules` with JAX's caches cleared first, so every kernel and op
    compiles anew."""
    jax.clear_caches()
    return hlo_dump.compiled_modules(run)


def runs_per_shard(modules, shard):
    """Whether a module partitioned over the 4 devices takes an operand of the ``shard`` shape:
    shard_map's per-device program of a kernel (its parameters are each device's shard)."""
    shape = f"[{','.join(map(str, shard))}]"
    return any("num_partitions=4" in text and shape in text.split("\n", 1)[0] for text in modules)


# The default impl (tiled) takes any split: a shard that is not whole bands of its tiles is drawn in the
# bands that cover it (the last case is a band a shard; (8, 4, 256) is seen with its first two dims
# swapped). Threefry, drawn per element, takes any split too.
DROPOUT_CASES = [("4x1", (16, 512), ("data", None), None), ("2x2", (16, 512), ("data", "model"), None),
                 ("1x4", (8, 4, 256), (None, None, "model"), None), ("2x2", (8, 4, 256), ("data", None, "model"), None),
                 ("2x2", (8, 4, 256), ("data", None, "model"), "threefry"), ("4x1", (256, 1024), ("data", None), None)]


@pytest.mark.parametrize("mesh,shape,spec,impl", DROPOUT_CASES, ids=[f"{m}-{'x'.join(map(str, s))}-{p}-{i or 'default'}"
                                                                    for m, s, p, i in DROPOUT_CASES])
def test_dropout_mask_and_gradient_are_the_unsharded_ones_without_all_gather(mesh, shape, spec, impl):
    values = torch.rand(shape) + 0.5
    with ENV:
        expected = torch_pallas.dropout(on_jax(values), 0.4, seed=7, impl=impl)
    x = on_jax(values, mesh_of(mesh), spec).requires_grad_()
    results = []

    def run():
        with ENV:
            y = torch_pallas.dropout(x, 0.4, seed=7, impl=impl)
            y.backward(torch.ones(shape, device="jax"))
        results.extend([y, x.grad])

    modules = compiled_modules(run)
    y, grad = results
    assert same_sharding(y, x) and same_sharding(grad, x)
    assert np.array_equal(bits(y), bits(expected))
    np.testing.assert_array_equal(np.asarray(array(grad)),
                                  (np.asarray(array(expected)) != 0) / keep_probability(0.4, impl or "tiled"))
    shard = [size // tiles for size, tiles in zip(shape, [MESHES[mesh][("data", "model").index(axis)] if axis else 1
                                                            for axis in spec])]
    assert runs_per_shard(modules, shard) and hlo_dump.all_gather_sizes(modules) == []


@pytest.mark.parametrize("distribution", ["uniform", "normal", "bernoulli"])
def test_random_with_a_mesh_is_the_unsharded_tensor_sharded(distribution):
    sample = getattr(torch_pallas.random, distribution)
    mesh, spec = mesh_of("2x2"), ("data", "model")
    with ENV:
        expected = sample((16, 512), seed=11, device="jax")
        out = sample((16, 512), seed=11, mesh=mesh, partition_spec=spec)
    assert array(out).sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec(*spec)), 2)
    assert np.array_equal(bits(out), bits(expected))


ATTENTION_CASES = [("4x1", ("data", None, None, None), False), ("1x4", (None, "model", None, None), False),
                   ("2x2", ("data", "model", None, None), True)]


@pytest.mark.parametrize("mesh,spec,gqa", ATTENTION_CASES, ids=[f"{m}-{s}-{g}" for m, s, g in ATTENTION_CASES])
def test_attention_runs_per_shard_with_the_unsharded_mask_and_no_all_gather(mesh, spec, gqa):
    query, key, value, mask, options = sharded_case(gqa)

    def attend(tensors, mask):
        with ENV:
            out = torch_pallas.scaled_dot_product_attention(*tensors, attn_mask=mask, **options)
            grads = torch.autograd.grad(out.square().sum(), tensors)
        return out, grads

    expected_out, expected_grads = attend([on_jax(t).requires_grad_() for t in (query, key, value)], on_jax(mask))
    parts = [on_jax(t, mesh_of(mesh), spec).requires_grad_() for t in (query, key, value)]
    sharded_mask = on_jax(mask, mesh_of(mesh), (spec[0], None, None, None))
    results = []
    modules = compiled_modules(lambda: results.extend(attend(parts, sharded_mask)))
    out, grads = results
    assert same_sharding(out, parts[0]) and all(same_sharding(g, p) for g, p in zip(grads, parts))
    assert runs_per_shard(modules, [4 // MESHES[mesh][0] if spec[0] else 4, 8 // MESHES[mesh][1] if spec[1] else 8,
                                    32, 16]) and hlo_dump.all_gather_sizes(modules) == []
    # Without GQA the whole call runs heads_in_lanes' kernels and a shard the flash kernels (heads_in_lanes
    # takes no shard): the same mask, values to rounding relative to each tensor's largest, as on the xla
    # stack (another mask would be off by whole weights).
    for got, expected in zip((out, *grads), (expected_out, *expected_grads)):
        expected = np.asarray(array(expected))
        np.testing.assert_allclose(np.asarray(array(got)), expected, rtol=1e-6, atol=1e-6 * np.abs(expected).max())


INDRNN_CASES = [("4x1", (None, "data", None)), ("2x2", (None, "data", "model"))]


@pytest.mark.parametrize("mesh,spec", INDRNN_CASES, ids=[f"{m}-{s}" for m, s in INDRNN_CASES])
def test_indrnn_sharded_equals_unsharded(mesh, spec):
    T, B, F = 12, 8, 256
    generator = torch.Generator().manual_seed(0)
    x, h0 = torch.randn(T, B, F, generator=generator), torch.randn(B, F, generator=generator)
    weight = torch.rand(F, generator=generator) * 1.8 - 0.9

    def run(x):
        x.requires_grad_()
        w, h = on_jax(weight).requires_grad_(), on_jax(h0).requires_grad_()
        with ENV:
            output, h_n = torch_pallas.indrnn(x, w, h, nonlinearity="tanh")
            (output.square().sum() + h_n.sum()).backward()
        return output, h_n, x.grad, w.grad, h.grad

    expected = run(on_jax(x))
    x_sharded = on_jax(x, mesh_of(mesh), spec)
    got = []
    modules = compiled_modules(lambda: got.extend(run(x_sharded)))
    output, _, grad_x, grad_w, _ = got
    assert same_sharding(output, x_sharded) and same_sharding(grad_x, x_sharded)
    assert runs_per_shard(modules, [T, B // 4 if mesh == "4x1" else B // 2, F if mesh == "4x1" else F // 2])
    # Only the weight gradient's rows (one per batch shard) are gathered, never activations.
    assert all(size <= 4 * F for size in hlo_dump.all_gather_sizes(modules)), hlo_dump.all_gather_sizes(modules)
    assert np.array_equal(bits(output), bits(expected[0])) and np.array_equal(bits(grad_x), bits(expected[2]))
    for name, a, b in zip(("output", "h_n", "grad x", "grad weight", "grad h0"), got, expected):
        b = np.asarray(array(b))
        np.testing.assert_allclose(np.asarray(array(a)), b, rtol=1e-6, atol=1e-6 * float(np.abs(b).max()),
                                   err_msg=name)


SAMPLING_CASES = [("1x4", (None, "model")), ("4x1", ("data", None)), ("2x2", ("data", "model"))]


@pytest.mark.parametrize("mesh,spec", SAMPLING_CASES, ids=[f"{m}-{s}" for m, s in SAMPLING_CASES])
def test_sampled_tokens_of_sharded_logits_are_the_unsharded_ones_without_gathering_them(mesh, spec):
    """A tensor-parallel lm_head's logits (split along the vocabulary), a batch split, both:
    the kernel runs on each shard, and the tokens are the unsharded call's."""
    values, arguments = sharded_logits_case()
    with ENV:
        expected = torch_pallas.sample_tokens(on_jax(values), **arguments)
    logits = on_jax(values, mesh_of(mesh), spec)
    got = []

    def run():
        with ENV:
            got.append(torch_pallas.sample_tokens(logits, **arguments))
    modules = compiled_modules(run)
    tokens, logprobs, raw_logprobs = got[0]
    assert np.asarray(array(tokens)).tolist() == np.asarray(array(expected.tokens)).tolist()
    np.testing.assert_allclose(np.asarray(array(logprobs)), np.asarray(array(expected.logprobs)), atol=1e-5)
    np.testing.assert_allclose(np.asarray(array(raw_logprobs)), np.asarray(array(expected.raw_logprobs)), atol=1e-5)
    tiles = [MESHES[mesh][("data", "model").index(axis)] if axis else 1 for axis in spec]
    assert runs_per_shard(modules, [8 // tiles[0], 1000 // tiles[1]])
    # Per-row partials and the shards' best tokens only: (8, shards) at most, never logits.
    assert all(size <= 8 * 4 for size in hlo_dump.all_gather_sizes(modules)), hlo_dump.all_gather_sizes(modules)


def test_errors_name_what_is_not_supported():
    mesh = mesh_of("2x2")
    with ENV:
        with pytest.raises(ValueError, match="one entry per dim"):
            torch_pallas.random.uniform((16, 512), mesh=mesh, partition_spec=("data",))
        with pytest.raises(ValueError, match="split along time"):
            torch_pallas.indrnn(on_jax(torch.randn(8, 4, 256), mesh, ("data", None, None)), on_jax(torch.ones(256)))
        with pytest.raises(ValueError, match="split along its length or head dim"):
            query = on_jax(torch.randn(2, 2, 32, 16), mesh_of("1x4"), (None, None, "model", None))
            torch_pallas.scaled_dot_product_attention(query, query, query)
