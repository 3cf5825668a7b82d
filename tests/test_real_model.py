"""A Hugging Face OPT model (small config, no weights) with every dropout routed to
torch_pallas and its layers checkpointed by torch_pallas.checkpoint: the example's run."""

import sys
from pathlib import Path

import pytest
import torch
import torch_xla

import torch_pallas
from torch_pallas import bridge
from torch_pallas.kernels import dropout as dropout_kernels

pytest.importorskip("transformers", reason="the test extra installs transformers: pip install -e '.[test]'")
sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
import train_transformer  # noqa: E402


def record_dropout_keys(monkeypatch) -> list:
    """Key data of every dropout kernel call from now on (forward, recomputation and
    backward; autograd runs the backward on another thread, so no dispatch mode sees it)."""
    keys, call = [], bridge.call

    def recording_call(jax_function, *tensors, **static):
        if jax_function is dropout_kernels.dropout:
            keys.append(tuple(tensors[0].cpu().tolist()))
        return call(jax_function, *tensors, **static)

    monkeypatch.setattr(bridge, "call", recording_call)
    return keys


def test_every_dropout_is_routed_and_recomputation_reuses_the_forward_keys(monkeypatch):
    torch.manual_seed(0)
    model = train_transformer.make_model().to(torch_xla.device()).train()
    ids = next(train_transformer.batches(torch.Generator().manual_seed(0))).to(torch_xla.device())
    loss = model(input_ids=ids, labels=ids).loss
    torch_dropouts = torch_xla._XLAC._get_xla_tensors_text([loss]).count("bernoulli")  # unrouted
    keys = record_dropout_keys(monkeypatch)
    with torch_pallas.route_dropout():
        loss = model(input_ids=ids, labels=ids).loss
    assert torch_xla._XLAC._get_xla_tensors_text([loss]).count("bernoulli") == 0
    forward = list(keys)
    loss.backward()
    backward = keys[len(forward):]
    # Each of torch's dropouts became one torch_pallas dropout with its own key, and the
    # checkpointed recomputation drew the same keys (the backward kernels too).
    assert torch_dropouts > 0 and len(forward) == len(set(forward)) == torch_dropouts
    assert len(backward) == 2 * len(forward) and set(backward) == set(forward)


def test_compiled_training_with_checkpointing_learns_and_compiles_nothing_after_warm_up():
    losses, compiles = train_transformer.train(steps=8)
    assert compiles[2] == compiles[-1], compiles
    assert losses[-1] < losses[0] - 0.5, losses
