"""Pins for claims of the README and the docs pages that no other test checks: each test names
the page and section (and the claim) it pins, as "docs/noise.md, Precision: ...". Where another
file already checks a claim, that test names the page and section instead (grep the suite for
"docs/" and "README,")."""

import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
import torch_xla
import torch_xla.debug.metrics as met
import torch_xla.utils.checkpoint

import torch_pallas
from kernel_calls import record_dropout_keys
from reference import jax_key, jax_random_part, key_data
from torch_pallas import _checks, bridge, sharding
from torch_pallas.kernels import dropout as dropout_kernels, sampling

SHAPE = (8, 128)  # one shape for the whole file: every new shape is a new XLA compile


def xla_ones():
    return torch.ones(SHAPE, device=torch_xla.device())


def masks(function, x, seed, calls=4):
    torch_xla.manual_seed(seed)
    return [(function(x) != 0).cpu() for _ in range(calls)]


def _dropout(x):
    return torch_pallas.dropout(x, 0.5)


def _torch_dropout(x):
    return torch.nn.functional.dropout(x, 0.5)


@pytest.mark.parametrize("function", [_dropout, _torch_dropout], ids=["torch_pallas", "torch"])
def test_noise_contract_compiled_noise_after_manual_seed(function):
    """docs/noise.md, Where a call's key comes from (and docs/limits.md): the call that compiles
    draws other noise than eager mode; after warm-up and torch_xla.manual_seed, the same
    compiled calls draw the same masks, a fresh one per call; only the first call's mask is
    eager mode's, later keys differ from eager mode's; torch's own dropout behaves the same."""
    x = xla_ones()
    compiled = torch.compile(function, backend="openxla", fullgraph=True)
    torch_xla.manual_seed(5)
    compiling_call = (compiled(x) != 0).cpu()  # draws once more while dynamo's bridge traces
    torch_xla.manual_seed(5)
    assert not torch.equal(compiling_call, (function(x) != 0).cpu())
    first, again, eager = masks(compiled, x, 5), masks(compiled, x, 5), masks(function, x, 5)
    assert all(torch.equal(a, b) for a, b in zip(first, again)), "not repeatable after torch_xla.manual_seed"
    assert all(not torch.equal(a, b) for a, b in zip(first, first[1:])), "a mask repeated"
    # Measured: [True, False, False, False] (torch's own F.dropout gives the same pattern).
    assert [torch.equal(a, b) for a, b in zip(first, eager)] == [True, False, False, False]


def region(layer, x):
    """A dropout whose mask shows in x's gradient (x > 0), then Linear + dropout."""
    hidden = torch_pallas.dropout(torch.relu(x), 0.5)
    return torch_pallas.dropout(layer(hidden), 0.3), hidden


def forward_and_backward_masks(step, layer):
    layer.zero_grad()
    x = (xla_ones() * 2).requires_grad_()
    out, hidden = step(x)
    (out.square().sum() + hidden.sum()).backward()
    return (hidden != 0).cpu(), (x.grad != 0).cpu()


def test_noise_contract_torch_xla_checkpoint_recomputes_other_masks_on_the_compiling_call():
    """docs/noise.md, Where a call's key comes from: with torch_xla.utils.checkpoint under torch.compile, the call
    that compiles recomputes with masks other than its forward's. (The later calls agreeing in
    a small region: test_checkpointing.py::test_torch_xla_checkpoint_under_compile_after_warm_up.)"""
    torch.manual_seed(0)
    layer = torch.nn.Linear(SHAPE[1], SHAPE[1]).to(torch_xla.device())
    step = torch.compile(lambda x: torch_xla.utils.checkpoint.checkpoint(region, layer, x), backend="openxla")
    forward_mask, backward_mask = forward_and_backward_masks(step, layer)
    assert not torch.equal(forward_mask, backward_mask)  # measured: 509 of 1024 elements differ
    forward_mask, backward_mask = forward_and_backward_masks(step, layer)
    assert torch.equal(forward_mask, backward_mask)


@pytest.mark.parametrize("checkpoint", [torch_xla.utils.checkpoint.checkpoint, torch_pallas.checkpoint],
                         ids=["torch_xla", "torch_pallas"])
def test_noise_contract_route_dropout_is_active_in_checkpoint_recomputation(monkeypatch, checkpoint):
    """docs/noise.md, Where a call's key comes from: a region checkpointed inside a route_dropout
    scope is recomputed routed, with its forward's key, by torch_xla.utils.checkpoint as by
    torch_pallas.checkpoint (backward after the scope)."""
    keys = record_dropout_keys(monkeypatch)
    x = (xla_ones() * 2).requires_grad_()
    with torch_pallas.route_dropout():
        y = checkpoint(lambda t: torch.nn.functional.dropout(t.relu(), 0.5), x)
    assert len(keys) == 1  # the forward: torch_pallas.dropout
    y.sum().backward()
    # torch_pallas's recomputation and its backward kernel both use the forward's key.
    assert keys[1:] == [keys[0]] * 2


def test_limits_checkpoint_region_is_a_graph_break():
    """docs/transformers.md, Checkpointing: under torch.compile a torch_pallas.checkpoint
    region runs as a graph break (so fullgraph=True refuses it)."""
    function = torch.compile(lambda t: torch_pallas.checkpoint(_dropout, t), backend="openxla", fullgraph=True)
    with pytest.raises(Exception, match="torch.compiler.disable"):
        function((xla_ones() * 2).requires_grad_())


def _seeded(x, seed):
    return torch_pallas.dropout(x, 0.5, seed=seed)


def test_limits_p_and_explicit_seed_under_compile_are_compiled_in():
    """docs/limits.md, Sizes, compiles and layouts: each distinct p compiles once, and an explicit
    seed= under torch.compile is a graph constant: a new seed value is traced again by dynamo
    (measured: no new XLA compile), and its mask is eager mode's for that seed."""
    from torch._dynamo.utils import counters

    x = xla_ones()
    compiled = torch.compile(_seeded, backend="openxla", fullgraph=True)

    def compiles_of(function):
        torch_xla.sync()
        before = met.metric_data("CompileTime")[0]
        function().cpu()
        return met.metric_data("CompileTime")[0] - before

    assert compiles_of(lambda: torch_pallas.dropout(x, 0.123)) > 0
    assert compiles_of(lambda: torch_pallas.dropout(x, 0.123)) == 0
    compiled(x, 2**40 + 1).cpu()
    traces = counters["stats"]["unique_graphs"]
    assert compiles_of(lambda: compiled(x, 2**40 + 1)) == 0
    assert counters["stats"]["unique_graphs"] == traces
    assert compiles_of(lambda: compiled(x, 2**40 + 2)) == 0
    assert counters["stats"]["unique_graphs"] == traces + 1, "a new seed value was not traced again"
    assert torch.equal(compiled(x, 2**40 + 2).cpu(), _seeded(x, 2**40 + 2).cpu())


def test_limits_tensors_of_2_32_elements_and_more_get_jax_random_noise():
    """docs/limits.md, Sizes, compiles and layouts: no limit on the number of elements; an index of
    2**32 or more uses the counter's high word, as jax.random does. Checked without allocating
    such a tensor: the argument checks take its shape, a shard's offset reaches the kernel as
    two words, and a shard past 2**32 draws jax.random's numbers (more in
    tests/kernels/test_sampling.py)."""
    shape = (2**18, 2**16)  # 2**34 elements
    assert _checks.check_shape(shape) == shape
    offsets = sharding.Sharding((4, 1), (0, 1, 2, 3)).shard_offset_words(shape)
    assert offsets.tolist() == [[[0, 0]], [[1, 0]], [[2, 0]], [[3, 0]]]  # [high, low] words: 0, 2**32, 2**33, 3 * 2**32
    seed, shard = 5, (8, 2**16)
    got = sampling.uniform(key_data(seed), shard, interpret=True, global_shape=shape,
                           shard_offset=offsets[3, 0] + [0, 2**16])  # at row 3 * 2**16 + 1
    expected = jax_random_part(lambda key: jax.random.uniform(key, shape), jax_key(seed),
                               (slice(3 * 2**16 + 1, 3 * 2**16 + 9), slice(None)))
    np.testing.assert_array_equal(np.asarray(got), expected)


def test_two_commands_example_trains_a_small_mlp_with_torch_pallas_dropout(monkeypatch, capsys):
    """README, Install and the two commands (and docs/install.md, Two commands): `./dev example`
    runs examples/train_mlp.py, which trains an MLP whose dropouts are torch_pallas's."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
    import train_mlp

    calls, call = [], bridge.call

    def counting_call(jax_function, *tensors, **static):
        calls.append(jax_function)  # under compile: once per kernel while dynamo traces
        return call(jax_function, *tensors, **static)

    monkeypatch.setattr(bridge, "call", counting_call)
    train_mlp.main(steps=3)
    printed = capsys.readouterr().out
    assert calls.count(dropout_kernels.dropout) >= 2, "the MLP's two dropouts are not torch_pallas's"
    assert "train loss" in printed and "XLA graphs compiled" in printed
