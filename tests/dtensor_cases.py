"""The DTensor cases of test_dtensor.py, run in real processes (gloo, CPU tensors): every rank
builds its shard of a global tensor with no collective (``DTensor.from_local``), runs the op, and
compares its local output and gradient with the same block of the unsharded call, which it
computes itself (through torch's own compute_local_shape_and_global_offset, a reference for
torch_pallas's dtensors.local_block). The op cases' checks do not communicate; the cases of
torch's parallel plans, of gathered masks and of replicated operands' gradients do, as those
features do, so a rank failing before such a collective leaves the others waiting until the
test's timeout."""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

SEED = 5
BANDS_SHAPE = (4, 64, 128)


def block_of(global_tensor, mesh, placements):
    """The local shard of ``global_tensor`` placed as ``placements`` (a Partial sum: all of it
    on the mesh coordinate 0 of that dim, zeros elsewhere) and its slices in the whole."""
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(global_tensor.shape, mesh, placements)
    slices = tuple(slice(start, start + size) for start, size in zip(offset, shape))
    local = global_tensor[slices].clone()
    coordinate = mesh.get_coordinate()
    for dim, placement in enumerate(placements):
        if isinstance(placement, Partial) and coordinate[dim] != 0:
            local = local * 0
    return local, slices


def distributed(global_tensor, mesh, placements):
    from torch.distributed.tensor import DTensor

    local, _ = block_of(global_tensor, mesh, placements)
    return DTensor.from_local(local.contiguous(), mesh, placements, run_check=False, shape=global_tensor.shape,
                              stride=global_tensor.stride())


def assert_block(got, whole, mesh, placements, what, exact=True, atol=1e-5):
    """``got``'s shard is what a rank holds of ``whole``, computed unsharded, placed as
    ``placements`` (a Partial output: all of it at coordinate 0, zeros elsewhere, as the inputs
    were built), bit for bit or (``exact=False``) within float32 tolerance (``atol``: for sums
    of many products)."""
    want = block_of(whole, mesh, placements)[0]
    assert tuple(got.placements) == tuple(placements), f"{what}: placements {got.placements} != {placements}"
    local = got.to_local()
    if not exact:
        torch.testing.assert_close(local, want, rtol=1e-5, atol=atol, msg=lambda message: f"{what}: {message}")
        return
    assert torch.equal(local, want), f"{what}: the shard differs from the unsharded call's block " \
                                     f"({(local != want).sum()} of {want.numel()} elements)"


def run_case(case: dict, mesh) -> None:
    """One case: an op (``op``: name), a global shape, dtype, placements, impl."""
    import torch_pallas
    from torch.distributed.tensor import Partial

    op, shape, placements, impl = case["op"], case["shape"], case["placements"], case.get("impl")
    dtype = case.get("dtype", torch.float32)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=generator).to(dtype)
    grad = torch.randn(shape, generator=generator).to(dtype)
    residual = torch.randn(shape, generator=generator).to(dtype)
    options = dict(impl=impl) if op not in ("routed", "routed-softmax") else {}
    if op in ("uniform", "normal", "bernoulli"):
        sample = getattr(torch_pallas.random, op)
        whole = sample(shape, seed=SEED, impl=impl, device="cpu")
        assert_block(sample(shape, seed=SEED, impl=impl, device_mesh=mesh, placements=placements), whole, mesh,
                     placements, "sample")
        return
    if op in ("dropout", "routed", "routed-softmax", "converted"):
        key = dict(seed=SEED) if case.get("key") == "seed" else {}

        def call(t):
            if op == "routed":
                with torch_pallas.route_dropout(impl=impl):
                    return torch.nn.functional.dropout(t, 0.3)
            if op == "routed-softmax":  # attention weights: the attention kernels' mask, on each rank's planes
                with torch_pallas.route_dropout(impl=impl):
                    return torch.nn.functional.dropout(torch.softmax(t, dim=-1), 0.3)
            if op == "converted":
                module = torch_pallas.convert_dropout(torch.nn.Dropout(0.3), impl=impl)
                return module(t)
            if not key:
                return torch_pallas.dropout(t, 0.3, shared_over_first_dim=case.get("shared", False), **options)
            return torch_pallas.dropout(t, 0.3, shared_over_first_dim=case.get("shared", False), **key, **options)
    elif op == "dropout_add":
        def call(t, r):
            return torch_pallas.dropout_add(t, r, 0.3, seed=SEED, **options)
    elif op == "dropout2d":
        def call(t):
            return torch_pallas.dropout2d(t, 0.3, seed=SEED, **options)
    else:
        raise ValueError(op)
    if case.get("compiled"):
        call = torch.compile(call, fullgraph=True)

    # Ranks draw alike: every one's generator is seeded alike before each call (what a user does).
    whole_x = x.clone().requires_grad_()
    whole_residual = residual.clone().requires_grad_()
    torch.manual_seed(SEED)
    whole = call(whole_x, whole_residual) if op == "dropout_add" else call(whole_x)
    whole.backward(whole_grad(whole, grad))
    sharded_x = distributed(x, mesh, placements).requires_grad_()
    sharded_residual = distributed(residual, mesh, placements).requires_grad_()
    torch.manual_seed(SEED)
    out = call(sharded_x, sharded_residual) if op == "dropout_add" else call(sharded_x)
    out.backward(distributed(whole_grad(whole, grad), mesh, out.placements))
    partial = any(isinstance(placement, Partial) for placement in placements)
    # (a Partial x's dropout_add is dropout then torch's add, which may differ from the fused
    # kernel's sum by the one rounding its docstring allows: XLA's CPU backend contracts the
    # kernel's product and sum into one FMA at its default optimization level, not at the
    # suite's level 0, where the two agree bit for bit)
    assert_block(out, whole.detach(), mesh, out.placements, "output", exact=not (op == "dropout_add" and partial))
    assert_block(sharded_x.grad, whole_x.grad, mesh, placements, "x's gradient")
    if op == "dropout_add" and not partial:
        # (a Partial residual's gradient is torch's business: its add reduces it to a Replicate one)
        assert_block(sharded_residual.grad, whole_residual.grad, mesh, placements, "residual's gradient")


def run_product_case(case: dict, mesh) -> None:
    """torch_pallas.dropout_linear or dropout_matmul (``op``) of DTensors (``operands``: name,
    global shape and placements each, in the op's order), eager or ``compiled`` (fullgraph): the
    fused kernel on each rank's shards where ``fused`` (its calls counted), else dropout then
    torch's product of DTensors; each
    rank's output and gradients = the blocks of the unsharded call, bit for bit those named in
    ``exact`` (the fused kernel's own rows and planes; a sum over ranks, or torch's products,
    within float32 tolerance)."""
    import importlib

    import torch_pallas
    from torch.distributed.tensor import Partial

    generator = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(shape, generator=generator) for name, shape, _ in case["operands"]}
    placements = {name: where for name, _, where in case["operands"]}
    function = getattr(torch_pallas, case["op"])
    options = dict(p=0.3, seed=SEED, impl=case["impl"])
    if "raises" in case:
        try:
            function(*(distributed(tensor, mesh, placements[name]) for name, tensor in tensors.items()), **options)
        except ValueError as error:
            assert case["raises"] in str(error), error
            return
        raise AssertionError(f"no ValueError ({case['raises']})")
    whole_inputs = {name: tensor.clone().requires_grad_() for name, tensor in tensors.items()}
    whole = function(*whole_inputs.values(), **options)
    grad = torch.randn(whole.shape, generator=generator)
    whole.backward(grad)
    sharded = {name: distributed(tensor, mesh, placements[name]).requires_grad_() for name, tensor in tensors.items()}
    ops = importlib.import_module(f"torch_pallas.ops.{case['op']}")
    calls, apply = [], ops.apply
    ops.apply = lambda *args, **kwargs: calls.append(kwargs) or apply(*args, **kwargs)
    try:
        sharded_call = torch.compile(function, fullgraph=True) if case.get("compiled") else function
        out = sharded_call(*sharded.values(), **options)
    finally:
        ops.apply = apply
    assert bool(calls) == case["fused"], f"fused kernel calls: {calls}"
    assert tuple(out.placements) == tuple(case["out_placements"]), out.placements
    out.backward(distributed(grad, mesh, out.placements))
    exact = case.get("exact", ())
    if any(isinstance(placement, Partial) for placement in out.placements):
        # (each rank's product of its features: compared summed)
        torch.testing.assert_close(out.full_tensor(), whole.detach(), rtol=1e-5, atol=1e-4)
    else:
        assert_block(out, whole.detach(), mesh, out.placements, "output", "output" in exact, atol=1e-4)
    for name, tensor in sharded.items():
        if not case["fused"]:  # (torch's DTensor autograd places the gradients as it sees fit)
            torch.testing.assert_close(tensor.grad.full_tensor(), whole_inputs[name].grad, rtol=1e-5, atol=1e-4)
            continue
        assert_block(tensor.grad, whole_inputs[name].grad, mesh, placements[name], f"{name}'s gradient", name in exact,
                     atol=1e-4)


def whole_grad(whole, grad):
    """A gradient for the unsharded output ``whole``: ``grad`` where it has the input's shape."""
    return grad if whole.shape == grad.shape else torch.randn(whole.shape, generator=torch.Generator().manual_seed(2))


def run_parallel_module_case(case: dict, mesh) -> None:
    """A converted block under torch's tensor-parallel plans (``parallelize_module``): its
    dropout gets the plan's DTensor, and the output and the input's gradient are the unsharded
    block's. ``sequence_parallel``: LayerNorm then Dropout, each ``SequenceParallel()`` (the input
    split along the sequence, Shard(1)); ``colwise``: a Linear ``ColwiseParallel(use_local_output=False)``
    (its output split along the features, Shard(2)), then Dropout."""
    import torch_pallas
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel, parallelize_module

    shape = case["shape"]
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=generator)
    grad = torch.randn(shape, generator=generator)

    def block():
        torch.manual_seed(0)
        first = torch.nn.LayerNorm(shape[-1]) if case["op"] == "sequence_parallel" else torch.nn.Linear(*shape[-1:] * 2)
        return torch_pallas.convert_dropout(torch.nn.Sequential(first, torch.nn.Dropout(0.3)))

    if case["op"] == "sequence_parallel":
        plan, input_placements, output_placements = {"0": SequenceParallel(), "1": SequenceParallel()}, [Shard(1)], [Shard(1)]
    else:
        plan, input_placements, output_placements = {"0": ColwiseParallel(use_local_output=False)}, None, [Shard(2)]
    whole_x = x.clone().requires_grad_()
    whole_block = block()
    torch.manual_seed(SEED)
    whole = whole_block(whole_x)
    whole.backward(grad)
    sharded_block = parallelize_module(block(), mesh, plan)
    local_x = (block_of(x, mesh, input_placements)[0] if input_placements else x.clone()).requires_grad_()
    torch.manual_seed(SEED)
    out = sharded_block(local_x)
    out.backward(distributed(grad, mesh, output_placements))
    assert_block(out, whole.detach(), mesh, output_placements, "output")
    if input_placements:  # (colwise: a replicated input's gradient is all-reduced by torch, not checked here)
        assert torch.equal(local_x.grad, block_of(whole_x.grad, mesh, input_placements)[0]), "x's gradient"


def worker(rank: int, world: int, store_path: str, cases: dict, results) -> None:
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        meshes = {}
        outcome = {}
        for name, case in cases.items():
            mesh_shape, names = case["mesh"], case.get("mesh_dim_names")
            if (mesh_shape, names) not in meshes:  # a collective: every rank, in order
                meshes[mesh_shape, names] = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
            runner = {"sequence_parallel": run_parallel_module_case, "colwise": run_parallel_module_case,
                      "gpt": run_gpt_case, "attention": run_attention_case,
                      "indrnn": run_indrnn_case, "IndRNN": run_indrnn_module_case,
                      "seeding": run_seeding_case, "dropout_linear": run_product_case,
                      "dropout_matmul": run_product_case, "sample_tokens": run_sampling_case}.get(case["op"], run_case)
            try:
                runner(case, meshes[mesh_shape, names])
                outcome[name] = None
            except Exception:  # noqa: BLE001  (reported to the test, which fails with it)
                outcome[name] = traceback.format_exc(limit=-4)
        results.put((rank, outcome))
    finally:
        dist.destroy_process_group()



def run_gpt_case(case: dict, mesh) -> None:
    """examples/train_tensor_parallel.py's training (``gpt2``: train_gpt2_tensor_parallel.py's,
    transformers' GPT-2 with torch_pallas's attention), two steps: a converted GPT under TP + SP
    over the mesh's "tp" dim and FSDP2 over its "dp" dim = the one-process model run on each
    half of the batch from the same seed, losses and every parameter's gradient within float32
    tolerance, so every dropout drew the one process's mask; with ``checkpointed`` blocks, their
    recomputation too."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
    if case.get("gpt2"):
        import train_gpt2_tensor_parallel

        losses = train_gpt2_tensor_parallel.train(mesh, steps=2, check_gradients=True)
    else:
        import train_tensor_parallel

        losses = train_tensor_parallel.train(mesh, steps=2, checkpointed=case["checkpointed"], check_gradients=True)
    for loss, single in losses:
        assert abs(loss - single) <= 1e-5 * abs(single), (loss, single)


def run_attention_case(case: dict, mesh) -> None:
    """torch_pallas's attention with dropout (causal, or a DTensor mask) of DTensors split over batch dims: each
    rank's output = the block of the unsharded call bit for bit, and the query, key and value
    gradients (and a learned mask's, summed over the ranks) within float32 tolerance (on jax
    0.10 the backward kernels, on fewer planes, can accumulate in another order)."""
    import torch_pallas

    placements = case["placements"]
    generator = torch.Generator().manual_seed(0)
    operands = [torch.randn(shape, generator=generator) for shape in (case["shape"], case["kv_shape"], case["kv_shape"])]
    grad = torch.randn(case["shape"], generator=generator)
    options = dict(dropout_p=0.3, seed=SEED, impl=case["impl"], enable_gqa=case["shape"] != case["kv_shape"])
    mask = None
    if "mask_shape" in case:  # a padding mask (bool) or a bias (float), in place of causality
        mask = torch.rand(case["mask_shape"], generator=generator) > 0.3
        mask = mask if case["mask_dtype"] == torch.bool else torch.where(mask, 0.0, -1e4)
    learned = case.get("mask_grad", False)  # a learned bias: its gradient is summed over the ranks
    whole_operands = [operand.clone().requires_grad_() for operand in operands]
    whole_mask = None if mask is None else mask.clone().requires_grad_(learned)
    whole = torch_pallas.scaled_dot_product_attention(*whole_operands, attn_mask=whole_mask, is_causal=mask is None,
                                                      **options)
    whole.backward(grad)
    sharded_operands = [distributed(operand, mesh, placements).requires_grad_() for operand in operands]
    sharded_mask = None if mask is None else distributed(mask, mesh, case["mask_placements"]).requires_grad_(learned)
    out = torch_pallas.scaled_dot_product_attention(*sharded_operands, attn_mask=sharded_mask, is_causal=mask is None,
                                                    **options)
    out.backward(distributed(grad, mesh, placements))
    assert_block(out, whole.detach(), mesh, placements, "output")
    for name, got, want in zip(("query", "key", "value"), sharded_operands, whole_operands):
        assert_block(got.grad, want.grad, mesh, placements, f"{name}'s gradient", exact=False)
    if learned:
        assert_block(sharded_mask.grad, whole_mask.grad, mesh, case["mask_placements"], "the mask's gradient",
                     exact=False)


def run_indrnn_case(case: dict, mesh) -> None:
    """torch_pallas.indrnn of a DTensor split over batch and/or features, its weight and h0
    DTensors placed to match: each rank's output, h_n and gradients of x and h0 = the blocks of
    the unsharded call bit for bit, and the weight's (summed over the batch shards by an
    all-reduce, in another order) within float32 tolerance."""
    import torch_pallas
    from torch.distributed.tensor import Replicate, Shard

    steps, batch, features = case["shape"]
    placements = case["placements"]
    state = [Shard(0 if p.dim == 1 else 1) if isinstance(p, Shard) else p for p in placements]
    weight_placements = [Shard(0) if isinstance(p, Shard) and p.dim == 2 else Replicate() for p in placements]
    generator = torch.Generator().manual_seed(0)
    x, h0 = torch.randn(case["shape"], generator=generator), torch.randn(batch, features, generator=generator)
    weight = torch.rand(features, generator=generator)
    grad, grad_h_n = torch.randn(case["shape"], generator=generator), torch.randn(batch, features, generator=generator)
    lengths = case.get("lengths")
    whole_inputs = [t.clone().requires_grad_() for t in (x, weight, h0)]
    whole_out, whole_h_n = torch_pallas.indrnn(*whole_inputs, lengths=lengths)
    torch.autograd.backward((whole_out, whole_h_n), (grad, grad_h_n))
    sharded = [distributed(t, mesh, p).requires_grad_() for t, p in ((x, placements), (weight, weight_placements),
                                                                       (h0, state))]
    out, h_n = torch_pallas.indrnn(*sharded, lengths=lengths)
    torch.autograd.backward((out, h_n), (distributed(grad, mesh, placements), distributed(grad_h_n, mesh, state)))
    assert_block(out, whole_out.detach(), mesh, placements, "output")
    assert_block(h_n, whole_h_n.detach(), mesh, state, "h_n")
    for name, got, want, where in zip(("x", "weight", "h0"), sharded, whole_inputs,
                                      (placements, weight_placements, state)):
        assert_block(got.grad, want.grad, mesh, where, f"{name}'s gradient", exact=name != "weight")


def run_indrnn_module_case(case: dict, mesh) -> None:
    """torch_pallas.nn.IndRNN (two bidirectional layers, dropout between them) on a DTensor input
    split along its batch, with a DTensor hx placed to match: each rank's output, h_n and the
    gradients of the input and hx = the blocks of the one-process module's, and its (plain)
    parameters' gradients, summed over the ranks, within float32 tolerance."""
    import torch_pallas
    from torch.distributed.tensor import Shard

    batch, steps, features, hidden = 4, 6, 16, 32
    placements, state = [Shard(0)], [Shard(1)]  # batch first: the input's batch is dim 0, hx's dim 1
    generator = torch.Generator().manual_seed(0)
    x, hx = torch.randn(batch, steps, features, generator=generator), torch.randn(4, batch, hidden, generator=generator)
    grad, grad_h_n = torch.randn(batch, steps, 2 * hidden, generator=generator), torch.randn(4, batch, hidden,
                                                                                            generator=generator)

    def module():
        torch.manual_seed(0)
        return torch_pallas.nn.IndRNN(features, hidden, num_layers=2, batch_first=True, dropout=0.3,
                                      bidirectional=True)

    whole_module, sharded_module = module(), module()
    whole_inputs = [t.clone().requires_grad_() for t in (x, hx)]
    torch.manual_seed(SEED)
    whole_out, whole_h_n = whole_module(*whole_inputs)
    torch.autograd.backward((whole_out, whole_h_n), (grad, grad_h_n))
    sharded = [distributed(x, mesh, placements).requires_grad_(), distributed(hx, mesh, state).requires_grad_()]
    torch.manual_seed(SEED)
    out, h_n = sharded_module(*sharded)
    torch.autograd.backward((out, h_n), (distributed(grad, mesh, placements), distributed(grad_h_n, mesh, state)))
    assert_block(out, whole_out.detach(), mesh, placements, "output", exact=False)
    assert_block(h_n, whole_h_n.detach(), mesh, state, "h_n", exact=False)
    assert_block(sharded[0].grad, whole_inputs[0].grad, mesh, placements, "input's gradient", exact=False)
    assert_block(sharded[1].grad, whole_inputs[1].grad, mesh, state, "hx's gradient", exact=False)
    for (name, got), want in zip(sharded_module.named_parameters(), whole_module.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-4, msg=lambda message: f"{name}: {message}")


def run_sampling_case(case: dict, mesh) -> None:
    """sample_tokens of DTensor logits: each rank samples its rows from its columns, with
    collectives for the reductions across the vocabulary; the tokens are the unsharded call's bit
    for bit, placed as the rows are, the log-probabilities within float32 rounding; a Partial sum
    is refused before any collective."""
    import pytest
    import torch_pallas
    from torch.distributed.tensor import Partial, Replicate, Shard

    from sampling_cases import sharded_logits_case

    values, arguments = sharded_logits_case(case["shape"][1])
    logits = distributed(values, mesh, case["placements"])
    if any(isinstance(placement, Partial) for placement in case["placements"]):
        with pytest.raises(ValueError, match="Partial"):
            torch_pallas.sample_tokens(logits, **arguments)
        return
    whole = torch_pallas.sample_tokens(values, **arguments)
    collectives, all_reduce = [], dist.all_reduce
    dist.all_reduce = lambda *args, **kwargs: collectives.append(kwargs.get("group")) or all_reduce(*args, **kwargs)
    try:
        got = torch_pallas.sample_tokens(logits, **arguments)
    finally:
        dist.all_reduce = all_reduce
    # Per mesh dim splitting the vocabulary, one all-reduce per reduction: the largest logit, min-p's
    # least key, each of top-k's 32 steps (float32 keys), top-p's total and each of its 32 steps (its three
    # mass digits in one), the best score and token, and the log-probabilities' four.
    splits = sum(isinstance(placement, Shard) and placement.dim % 2 == 1 for placement in case["placements"])
    assert len(collectives) == splits * (2 + 32 + 1 + 32 + 2 + 4), len(collectives)
    rows = [Shard(0) if placement == Shard(0) else Replicate() for placement in case["placements"]]
    assert_block(got.tokens, whole.tokens, mesh, rows, "tokens")
    # Per-row arguments as DTensors too (replicated seeds, temperatures split along the batch): their values.
    as_dtensors = dict(arguments, seeds=distributed(torch.tensor(arguments["seeds"]), mesh, [Replicate()] * mesh.ndim),
                       temperature=distributed(arguments["temperature"], mesh, [Shard(0)] + [Replicate()] * (mesh.ndim - 1)))
    assert_block(torch_pallas.sample_tokens(logits, **as_dtensors).tokens, whole.tokens, mesh, rows,
                 "tokens of DTensor seeds and temperatures")
    with pytest.raises(ValueError, match=r"seeds is a DTensor placed .*Partial.*redistribute"):
        torch_pallas.sample_tokens(logits, **dict(arguments, seeds=distributed(
            torch.tensor(arguments["seeds"]), mesh, [Partial()] + [Replicate()] * (mesh.ndim - 1))))
    assert_block(got.logprobs, whole.logprobs, mesh, rows, "logprobs", exact=False)
    assert_block(got.raw_logprobs, whole.raw_logprobs, mesh, rows, "raw logprobs", exact=False)
    tokens = torch_pallas.sample_tokens(logits, **dict(arguments, return_logprobs=False))
    assert_block(tokens, whole.tokens, mesh, rows, "tokens without logprobs")


def run_seeding_case(case: dict, mesh) -> None:
    """docs/sharding.md's keys: after accelerate's ``set_seed(seed)`` every rank draws the same
    mask for a plain tensor, and a DTensor's shards draw the unsharded tensor's; after
    ``set_seed(seed, device_specific=True)``'s seed + rank each rank draws its own mask, as data
    parallelism wants, and the shards of a DTensor no longer draw one tensor's."""
    import torch_pallas
    from accelerate.utils import set_seed
    from torch.distributed.tensor import Shard

    x = torch.ones(*BANDS_SHAPE)
    masks = {}
    for device_specific in (False, True):
        # device_specific=True adds accelerate's process index, the rank under its launcher (its
        # state needs that launcher's environment, which these workers do not have).
        set_seed(SEED + dist.get_rank() if device_specific else SEED)
        local = torch_pallas.dropout(x, 0.3) != 0
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, local)
        masks[device_specific] = all(torch.equal(gathered[0], other) for other in gathered[1:])
        set_seed(SEED + dist.get_rank() if device_specific else SEED)
        shard = torch_pallas.dropout(distributed(x, mesh, [Shard(0)]), 0.3).to_local()
        set_seed(SEED)
        whole = torch_pallas.dropout(x, 0.3)
        masks[device_specific, "one tensor's"] = torch.equal(shard, block_of(whole, mesh, [Shard(0)])[0])
    assert masks[False] and masks[False, "one tensor's"], masks
    assert not masks[True], "set_seed(device_specific=True): every rank drew the same mask"
    if mesh.get_coordinate()[0] != 0:  # (rank 0's seed is seed + 0)
        assert not masks[True, "one tensor's"], masks
