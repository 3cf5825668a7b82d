"""docs/sharding.md, DTensors: torch_pallas's ops take ``torch.distributed`` DTensors (dropout and
its channel variants, dropout_add, dropout_linear, dropout_matmul, random.* with device_mesh=,
attention, indrnn, nn.IndRNN, sample_tokens), each rank drawing its shard's part of the whole tensor's noise: sharded
equals unsharded, bit for bit where the same kernels run (tolerances are named in the cases), on
2 and 4 real processes (gloo, CPU tensors), each group in processes of its own
(tests/dtensor_cases.py runs the cases); and examples/train_tensor_parallel.py's and
examples/train_gpt2_tensor_parallel.py's TP + SP + FSDP2 training equals one process."""

import multiprocessing
import os
import tempfile

import pytest
import torch

from torch.distributed.tensor import Partial, Replicate, Shard

from conftest import STACK
from dtensor_cases import worker

# (global shape, why): a tensor whose tiled 2-D view is one row (uneven shards cut its tiles), one
# whose dims split evenly into whole bands of tiles only along the batch, and a 2-D one.
ONE_ROW, BANDS, MATRIX = (3, 50, 40), (4, 64, 128), (8, 384)


def named(placements) -> str:
    """Placements as a case's name spells them on every torch: S(0), R, P (torch 2.14 prints P(sum))."""
    return "".join("P" if isinstance(placement, Partial) else str(placement) for placement in placements)


CASES = {2: {}, 4: {}}
for world, mesh in ((2, (2,)), (4, (4,)), (4, (2, 2))):
    one_dim = len(mesh) == 1
    placement_sets = ([[Shard(0)], [Shard(1)], [Shard(2)], [Replicate()], [Partial()]] if one_dim else
                      [[Shard(0), Shard(1)], [Shard(1), Shard(1)], [Replicate(), Shard(2)], [Shard(1), Partial()]])
    # (4 ranks on one dim add uneven and empty shards, where the per-tile impls pad and scatter)
    for impl in ("tiled", "threefry") if world == 2 or not one_dim else ("tiled",):
        for shape in (ONE_ROW, BANDS):
            for placements in placement_sets:
                name = f"dropout-{impl}-{'x'.join(map(str, shape))}-{named(placements)}-mesh{mesh}"
                CASES[world][name] = dict(op="dropout", impl=impl, shape=shape, placements=placements, mesh=mesh,
                                          key="seed")
    sample_placements = [placements for placements in placement_sets if not any(
        isinstance(placement, Partial) for placement in placements)]
    samples = (("uniform", "tiled", ONE_ROW), ("normal", "threefry", BANDS)) if world == 2 or not one_dim else ()
    for op, impl, shape in samples + ((("bernoulli", "tiled", BANDS),) if world == 2 else ()):
        for placements in sample_placements if op != "bernoulli" else [[Shard(1)]]:
            name = f"{op}-{impl}-{'x'.join(map(str, shape))}-{named(placements)}-mesh{mesh}"
            CASES[world][name] = dict(op=op, impl=impl, shape=shape, placements=placements, mesh=mesh)
    if one_dim:
        more = {
            "matrix-rows-bfloat16": dict(op="dropout", impl="tiled", shape=MATRIX, placements=[Shard(0)],
                                         dtype=torch.bfloat16, key="seed"),
            "matrix-columns": dict(op="dropout", impl="tiled", shape=MATRIX, placements=[Shard(1)], key="seed"),
            "shared-mask-threefry": dict(op="dropout", impl="threefry", shape=BANDS, placements=[Shard(1)],
                                         shared=True, key="seed"),
            # (padded to the bands of the one row of the shared noise; split along the last dim, scattered)
            "shared-mask-tiled": dict(op="dropout", impl="tiled", shape=ONE_ROW, placements=[Shard(1)], shared=True,
                                      key="seed"),
            "shared-mask-tiled-columns": dict(op="dropout", impl="tiled", shape=BANDS, placements=[Shard(2)],
                                              shared=True, key="seed"),
            "generator-key-seeded-alike": dict(op="dropout", impl="tiled", shape=BANDS, placements=[Shard(1)]),
            "routed-F.dropout": dict(op="routed", impl=None, shape=BANDS, placements=[Shard(1)]),
            "routed-attention-weights-heads": dict(op="routed-softmax", impl=None, shape=(2, 4, 16, 128),
                                                   placements=[Shard(1)]),
            "converted-nn.Dropout": dict(op="converted", impl=None, shape=ONE_ROW, placements=[Shard(1)]),
            "dropout_add": dict(op="dropout_add", impl="tiled", shape=ONE_ROW, placements=[Shard(1)]),
            "dropout_add-partial": dict(op="dropout_add", impl="tiled", shape=ONE_ROW, placements=[Partial()]),
            "dropout2d-channels": dict(op="dropout2d", impl="tiled", shape=(4, 6, 8, 8), placements=[Shard(1)]),
            "dropout2d-spatial": dict(op="dropout2d", impl="tiled", shape=(4, 6, 8, 8), placements=[Shard(2)]),
            "sequence-parallel-converted-block": dict(op="sequence_parallel", shape=BANDS),
            "colwise-parallel-converted-block": dict(op="colwise", shape=BANDS),
        }
        if world == 2:  # (dynamo's compile takes a rank 15 s: once)
            more["compiled-fullgraph"] = dict(op="dropout", impl="tiled", shape=ONE_ROW, placements=[Shard(1)],
                                              key="seed", compiled=True)
        for name, case in more.items():
            CASES[world][f"{name}-mesh{mesh}"] = dict(case, mesh=mesh)


# dropout_linear and dropout_matmul: (operands' shapes and placements on a mesh of 2, impl, the
# output's placements, fused, what is bit for bit). Fused, each rank's rows (linear: a kernel per
# sequence for a split along it, padded to the rows its mask starts at) or planes run in the kernel.
# A product over fewer output features (the weight split) may round otherwise: jax 0.10's dot, and
# jax 0.7.1's on a CPU without AVX-512 (the weight's gradient of a column split, 228 of 2048 elements apart
# on an AVX2 machine, 2026-12-01, with or without this session's changes).
X, WEIGHT, WEIGHTS, VALUE = "x", "weight", "weights", "value"
PRODUCTS = {
    "dropout_linear-rows": ({X: (BANDS, [Shard(0)]), WEIGHT: ((32, 128), [Replicate()])}, "tiled", [Shard(0)], True,
                            ("output", X)),
    "dropout_linear-sequence-uneven-threefry": ({X: ((3, 25, 128), [Shard(1)]), WEIGHT: ((32, 128), [Replicate()])},
                                                "threefry", [Shard(1)], True, ("output", X)),
    "dropout_linear-sequence-uneven": ({X: ((3, 25, 128), [Shard(1)]), WEIGHT: ((32, 128), [Replicate()])}, "tiled",
                                       [Shard(1)], True, ("output", X)),
    "dropout_linear-columns-tensor-parallel-bias": ({X: (BANDS, [Replicate()]), WEIGHT: ((32, 128), [Shard(0)]),
                                                     "bias": ((32,), [Shard(0)])}, "tiled", [Shard(2)], True,
                                                    ()),
    "dropout_linear-features-row-parallel-unfused": ({X: (BANDS, [Shard(2)]), WEIGHT: ((32, 128), [Shard(1)])},
                                                     "tiled", [Partial()], False, ()),
    "dropout_matmul-batch-threefry": ({WEIGHTS: ((4, 2, 16, 16), [Shard(0)]), VALUE: ((4, 2, 16, 8), [Shard(0)])},
                                      "threefry", [Shard(0)], True, ("output", WEIGHTS, VALUE)),
    "dropout_matmul-heads-uneven": ({WEIGHTS: ((2, 3, 16, 128), [Shard(1)]), VALUE: ((2, 3, 128, 8), [Shard(1)])},
                                    "tiled", [Shard(1)], True, ("output", WEIGHTS, VALUE)),
    "dropout_matmul-replicated-value-threefry-unfused": (
        {WEIGHTS: ((4, 2, 16, 16), [Shard(0)]), VALUE: ((4, 2, 16, 8), [Replicate()])}, "threefry", [Shard(0)],
        False, ()),
}
for name, (operands, impl, out_placements, fused, exact) in PRODUCTS.items():
    CASES[2][f"{name}-mesh(2,)"] = dict(op=name.split("-")[0], operands=[(n, *o) for n, o in operands.items()],
                                        impl=impl, out_placements=out_placements, fused=fused, exact=exact, mesh=(2,))
CASES[2]["dropout_linear-rows-compiled-fullgraph-mesh(2,)"] = dict(
    CASES[2]["dropout_linear-rows-mesh(2,)"], compiled=True)
CASES[2]["dropout_matmul-rows-tiled-refused-mesh(2,)"] = dict(
    op="dropout_matmul", operands=[(WEIGHTS, (4, 2, 16, 16), [Shard(2)]), (VALUE, (4, 2, 16, 8), [Replicate()])],
    impl="tiled", raises='pass impl="threefry"', mesh=(2,))
CASES[4]["dropout_linear-rows-of-tiles-mesh(4,)"] = dict(
    op="dropout_linear", operands=[(X, (4, 256, 128), [Shard(0)]), (WEIGHT, (32, 128), [Replicate()])], impl="tiled",
    out_placements=[Shard(0)], fused=True, exact=("output", X), mesh=(4,))
CASES[4]["dropout_linear-rows-and-columns-mesh(2, 2)"] = dict(
    op="dropout_linear", operands=[(X, BANDS, [Shard(0), Replicate()]), (WEIGHT, (32, 128), [Replicate(), Shard(0)])],
    impl="tiled", out_placements=[Shard(0), Shard(2)], fused=True, exact=(), mesh=(2, 2))
CASES[4]["dropout_matmul-batch-and-heads-mesh(2, 2)"] = dict(
    op="dropout_matmul", operands=[(WEIGHTS, (4, 2, 16, 16), [Shard(0), Shard(1)]),
                                   (VALUE, (4, 2, 16, 8), [Shard(0), Shard(1)])],
    impl="tiled", out_placements=[Shard(0), Shard(1)], fused=True, exact=("output", WEIGHTS, VALUE), mesh=(2, 2))

HEADS, GQA_HEADS = (4, 4, 32, 16), (4, 2, 32, 16)
for world, mesh, placements, kv_shape, impl in (
        (2, (2,), [Shard(0)], HEADS, "tiled"), (2, (2,), [Shard(1)], GQA_HEADS, "threefry"),
        (4, (4,), [Shard(1)], HEADS, "tiled"), (4, (2, 2), [Shard(0), Shard(1)], HEADS, "tiled")):
    name = f"attention-{impl}-{'gqa-' if kv_shape != HEADS else ''}{named(placements)}-mesh{mesh}"
    CASES[world][name] = dict(op="attention", shape=HEADS, kv_shape=kv_shape, placements=placements, mesh=mesh,
                              impl=impl)
CASES[2]["attention-padding-mask-split-with-the-batch-mesh(2,)"] = dict(
    op="attention", shape=HEADS, kv_shape=HEADS, placements=[Shard(0)], mesh=(2,), impl="tiled",
    mask_shape=(4, 1, 32, 32), mask_dtype=torch.bool, mask_placements=[Shard(0)])
CASES[2]["attention-learned-bias-split-with-the-heads-mesh(2,)"] = dict(
    op="attention", shape=HEADS, kv_shape=HEADS, placements=[Shard(1)], mesh=(2,), impl="tiled",
    mask_shape=(1, 4, 32, 32), mask_dtype=torch.float32, mask_placements=[Shard(1)], mask_grad=True)
CASES[4]["attention-learned-bias-replicated-mesh(2, 2)"] = dict(
    op="attention", shape=HEADS, kv_shape=HEADS, placements=[Shard(0), Shard(1)], mesh=(2, 2), impl="tiled",
    mask_shape=(4, 32, 32), mask_dtype=torch.float32, mask_placements=[Replicate(), Replicate()], mask_grad=True)
CASES[4]["attention-bias-replicated-mesh(2, 2)"] = dict(
    op="attention", shape=HEADS, kv_shape=HEADS, placements=[Shard(0), Shard(1)], mesh=(2, 2), impl="tiled",
    mask_shape=(32, 32), mask_dtype=torch.float32, mask_placements=[Replicate(), Replicate()])
for world, mesh, placements, lengths in ((2, (2,), [Shard(1)], [8, 3, 0, 5]), (2, (2,), [Shard(2)], None),
                                         (4, (2, 2), [Shard(1), Shard(2)], [8, 3, 0, 5])):
    name = f"indrnn-{named(placements)}{'-lengths' if lengths else ''}-mesh{mesh}"
    CASES[world][name] = dict(op="indrnn", shape=(8, 4, 128), placements=placements, mesh=mesh, lengths=lengths)
CASES[2]["nn.IndRNN-batch-mesh(2,)"] = dict(op="IndRNN", mesh=(2,))
CASES[2]["accelerate-set_seed-device_specific-mesh(2,)"] = dict(op="seeding", mesh=(2,))
for checkpointed in (False, True):
    CASES[4][f"train_tensor_parallel-tp-sp-fsdp2{'-checkpointed' if checkpointed else ''}-mesh(2, 2)"] = dict(
        op="gpt", mesh=(2, 2), mesh_dim_names=("dp", "tp"), checkpointed=checkpointed)
CASES[4]["train_gpt2_tensor_parallel-transformers-gpt2-tp-sp-fsdp2-mesh(2, 2)"] = dict(
    op="gpt", mesh=(2, 2), mesh_dim_names=("dp", "tp"), gpt2=True)

# sample_tokens: a tensor-parallel lm_head's logits (the vocabulary split, unevenly too), the batch
# split, both, the vocabulary over two mesh dims, replicated; a Partial sum refused.
for world, mesh, placements, vocabulary in ((2, (2,), [Shard(1)], 999), (2, (2,), [Shard(0)], 1000),
                                            (2, (2,), [Replicate()], 1000), (2, (2,), [Partial()], 1000),
                                            (4, (2, 2), [Shard(0), Shard(1)], 1000),
                                            (4, (2, 2), [Shard(1), Shard(1)], 1000)):
    CASES[world][f"sample_tokens-{named(placements)}-V{vocabulary}-mesh{mesh}"] = dict(
        op="sample_tokens", shape=(8, vocabulary), placements=placements, mesh=mesh)

# The cases every run checks: each op, placement kind (split, uneven and empty shards, replicated,
# partial, two mesh dims), impl and client once. A group's time is its processes' kernel compiles (a
# case of shapes already compiled takes a fraction of a second), so the slow tier adds the cases
# whose kernels or shapes only combine what these check (on four ranks, attention on a 2-D mesh, 34 s of
# compiles on two cores, its shards split over batch dims as on one mesh dim; the colwise plan, 15 s, as on
# two ranks and in the TP + SP + FSDP2 training).
FAST = {2: {
    "dropout-tiled-3x50x40-S(0)-mesh(2,)", "dropout-tiled-3x50x40-S(1)-mesh(2,)", "dropout-tiled-3x50x40-S(2)-mesh(2,)",
    "dropout-tiled-3x50x40-R-mesh(2,)", "dropout-tiled-3x50x40-P-mesh(2,)", "dropout-tiled-4x64x128-S(0)-mesh(2,)",
    "dropout-tiled-4x64x128-S(2)-mesh(2,)", "dropout-threefry-3x50x40-S(1)-mesh(2,)",
    "dropout-threefry-4x64x128-S(0)-mesh(2,)", "dropout-threefry-4x64x128-P-mesh(2,)",
    "uniform-tiled-3x50x40-S(1)-mesh(2,)", "normal-threefry-4x64x128-S(2)-mesh(2,)",
    "matrix-rows-bfloat16-mesh(2,)", "matrix-columns-mesh(2,)", "shared-mask-threefry-mesh(2,)",
    "shared-mask-tiled-mesh(2,)", "generator-key-seeded-alike-mesh(2,)", "routed-F.dropout-mesh(2,)",
    "routed-attention-weights-heads-mesh(2,)", "converted-nn.Dropout-mesh(2,)", "dropout_add-partial-mesh(2,)",
    "dropout2d-channels-mesh(2,)", "sequence-parallel-converted-block-mesh(2,)",
    "colwise-parallel-converted-block-mesh(2,)", "compiled-fullgraph-mesh(2,)", "dropout_linear-rows-mesh(2,)",
    "dropout_linear-sequence-uneven-mesh(2,)", "dropout_linear-columns-tensor-parallel-bias-mesh(2,)",
    "dropout_linear-features-row-parallel-unfused-mesh(2,)", "dropout_linear-rows-compiled-fullgraph-mesh(2,)",
    "dropout_matmul-heads-uneven-mesh(2,)", "dropout_matmul-replicated-value-threefry-unfused-mesh(2,)",
    "dropout_matmul-rows-tiled-refused-mesh(2,)", "attention-tiled-S(0)-mesh(2,)",
    "attention-threefry-gqa-S(1)-mesh(2,)", "attention-learned-bias-split-with-the-heads-mesh(2,)",
    "indrnn-S(1)-lengths-mesh(2,)", "nn.IndRNN-batch-mesh(2,)", "accelerate-set_seed-device_specific-mesh(2,)",
    "sample_tokens-S(1)-V999-mesh(2,)", "sample_tokens-S(0)-V1000-mesh(2,)", "sample_tokens-P-V1000-mesh(2,)"},
    4: {
    "dropout-tiled-3x50x40-S(0)-mesh(4,)", "dropout-tiled-3x50x40-S(1)-mesh(4,)", "dropout-tiled-3x50x40-P-mesh(4,)",
    "generator-key-seeded-alike-mesh(4,)", "routed-F.dropout-mesh(4,)", "converted-nn.Dropout-mesh(4,)",
    "dropout_add-partial-mesh(4,)", "dropout2d-spatial-mesh(4,)", "sequence-parallel-converted-block-mesh(4,)",
    "dropout-tiled-4x64x128-S(0)S(1)-mesh(2, 2)", "dropout-tiled-4x64x128-S(1)S(1)-mesh(2, 2)",
    "dropout-tiled-4x64x128-RS(2)-mesh(2, 2)", "dropout-tiled-3x50x40-S(1)P-mesh(2, 2)",
    "dropout-threefry-3x50x40-S(1)P-mesh(2, 2)", "dropout-threefry-4x64x128-S(0)S(1)-mesh(2, 2)",
    "uniform-tiled-3x50x40-RS(2)-mesh(2, 2)", "dropout_linear-rows-and-columns-mesh(2, 2)",
    "indrnn-S(1)S(2)-lengths-mesh(2, 2)", "train_tensor_parallel-tp-sp-fsdp2-checkpointed-mesh(2, 2)",
    "sample_tokens-S(0)S(1)-V1000-mesh(2, 2)"}}
# The TorchTPU stack (torch 2.14), whose users shard with DTensors, runs FAST; the torch_xla
# stack's users shard with SPMD, and there (torch 2.9) a run checks the ops and plans on two ranks
# (the DTensor cases were a fifth of that suite's CPU time): FAST_ON_TORCH_XLA, the rest in the slow tier.
FAST_ON_TORCH_XLA = {2: {
    "dropout-tiled-3x50x40-S(1)-mesh(2,)", "dropout-threefry-4x64x128-P-mesh(2,)", "dropout_add-partial-mesh(2,)",
    "sequence-parallel-converted-block-mesh(2,)", "colwise-parallel-converted-block-mesh(2,)",
    "compiled-fullgraph-mesh(2,)", "dropout_linear-rows-mesh(2,)", "dropout_matmul-heads-uneven-mesh(2,)",
    "attention-tiled-S(0)-mesh(2,)", "indrnn-S(1)-lengths-mesh(2,)", "sample_tokens-S(1)-V999-mesh(2,)"}, 4: set()}
assert all(fast[world] <= set(CASES[world]) for fast in (FAST, FAST_ON_TORCH_XLA) for world in CASES), \
    [fast[w] - set(CASES[w]) for fast in (FAST, FAST_ON_TORCH_XLA) for w in CASES]
RUN_FAST = FAST_ON_TORCH_XLA if STACK == "xla" else FAST


@pytest.fixture(scope="module")
def outcomes(request):
    """Every case's outcome on every rank: {world: {case: [None or the failure, per rank]}}."""
    context = multiprocessing.get_context("spawn")
    everything = {}
    # The cases of this run's tests that will run (not deselected, not skipped: the slow tier's are
    # without --slow), so a run starts no process for a case nothing reads.
    running = {(item.callspec.params["world"], item.callspec.params["name"]) for item in request.session.items
               if item.function is test_a_dtensor_shard_draws_its_part_of_the_unsharded_noise
               and not item.get_closest_marker("skip")}
    for world, cases in CASES.items():
        cases = {name: case for name, case in cases.items() if (world, name) in running}
        if not cases:
            everything[world] = {}
            continue
        with tempfile.TemporaryDirectory() as directory:
            results = context.Queue()
            processes = [context.Process(target=worker, args=(rank, world, os.path.join(directory, "store"),
                                                              cases, results)) for rank in range(world)]
            for process in processes:
                process.start()
            # A group's cases took up to 9 minutes on a loaded 2-core machine: the wait fails only a hung group.
            by_rank = dict(results.get(timeout=1800) for _ in processes)
            for process in processes:
                process.join(timeout=60)
        everything[world] = {name: [by_rank[rank][name] for rank in range(world)] for name in cases}
    return everything


@pytest.mark.parametrize("world,name", [
    pytest.param(world, name, marks=() if name in RUN_FAST[world] else pytest.mark.slow)
    for world, cases in CASES.items() for name in cases])
def test_a_dtensor_shard_draws_its_part_of_the_unsharded_noise(outcomes, world, name):
    failures = [f"rank {rank}: {failure}" for rank, failure in enumerate(outcomes[world][name]) if failure]
    assert not failures, "\n".join(failures)
