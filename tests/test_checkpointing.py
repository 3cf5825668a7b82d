"""torch_pallas.checkpoint: the recomputation draws its forward's masks, eager and compiled."""

import pytest
import torch
import torch_xla
import torch_xla.utils.checkpoint

import torch_pallas
from torch_pallas import seeds

SHAPE = (64, 256)


def make_layer():
    torch.manual_seed(0)
    return torch.nn.Linear(SHAPE[1], SHAPE[1]).to(torch_xla.device())


def region(layer, x):
    """Two dropouts: the first's mask shows in x's gradient (x > 0, so ReLU passes all)."""
    hidden = torch_pallas.dropout(torch.relu(x), 0.5)
    return torch_pallas.dropout(layer(hidden), 0.3), hidden


def positive_input():
    return (torch.rand(SHAPE, generator=torch.Generator().manual_seed(1)) + 0.5).to(torch_xla.device())


def run(step, layer):
    """One forward and backward; returns (forward mask, mask seen by x's gradient, weight grad)."""
    layer.zero_grad()
    x = positive_input().requires_grad_()
    out, hidden = step(x)
    (out.square().sum() + hidden.sum()).backward()
    return (hidden != 0).cpu(), (x.grad != 0).cpu(), layer.weight.grad.cpu()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_recomputation_draws_the_forward_masks(compiled):
    """docs/noise.md, Where a call's key comes from, and docs/transformers.md, Checkpointing: the
    recomputation draws the forward's noise, eager and compiled."""
    layer = make_layer()

    def step(x):
        return torch_pallas.checkpoint(region, layer, x)

    step = torch.compile(step, backend="openxla") if compiled else step
    torch_xla.manual_seed(3)
    masks = []
    for _ in range(3):  # the first call compiles; every call must agree
        forward_mask, backward_mask, _ = run(step, layer)
        assert torch.equal(forward_mask, backward_mask)
        masks.append(forward_mask)
    assert not torch.equal(masks[0], masks[1]), "each call draws a fresh key"


def test_gradients_equal_the_unchekpointed_region_with_the_same_key():
    layer = make_layer()
    torch_xla.manual_seed(5)
    checkpointed = run(lambda x: torch_pallas.checkpoint(region, layer, x), layer)
    torch_xla.manual_seed(5)
    key_data = seeds.key_data()  # the key checkpoint draws first

    def plain(x):
        with seeds.key_scope(key_data):
            return region(layer, x)

    expected = run(plain, layer)
    for got, want in zip(checkpointed, expected):
        torch.testing.assert_close(got, want)


def test_torch_xla_checkpoint_under_compile_after_warm_up():
    """docs/noise.md, Where a call's key comes from: with torch_xla.utils.checkpoint, later compiled
    calls agreed in the small regions tested."""
    # torch_xla's own checkpoint restores the XLA RNG before recomputing; under compile this
    # holds from the second call on (the call that compiles draws while tracing).
    layer = make_layer()
    step = torch.compile(lambda x: torch_xla.utils.checkpoint.checkpoint(region, layer, x), backend="openxla")
    run(step, layer)
    for _ in range(2):
        forward_mask, backward_mask, _ = run(step, layer)
        assert torch.equal(forward_mask, backward_mask)


def test_keyword_arguments_reach_the_function_and_use_reentrant_false_raises():
    x = positive_input().requires_grad_()
    out = torch_pallas.checkpoint(lambda x, *, scale: x * scale, x, scale=3.0)
    assert torch.equal(out.cpu(), (x * 3).detach().cpu())
    with pytest.raises(ValueError, match="use_reentrant=False"):
        torch_pallas.checkpoint(torch.sin, x, use_reentrant=False)
    with pytest.raises(TypeError, match="function must be callable"):
        torch_pallas.checkpoint(None, x)


def test_cpu_region_recomputes_its_forward_masks():
    torch.manual_seed(0)
    layer = torch.nn.Linear(SHAPE[1], SHAPE[1])
    x = positive_input().cpu().requires_grad_()
    out, hidden = torch_pallas.checkpoint(region, layer, x)
    (out.square().sum() + hidden.sum()).backward()
    assert hidden.device.type == "cpu" and torch.equal(hidden != 0, x.grad != 0)


def routed_region(layer, x):
    """region's dropouts as a model writes them: F.dropout, routed by route_dropout."""
    hidden = torch.nn.functional.dropout(torch.relu(x), 0.5)
    return torch.nn.functional.dropout(layer(hidden), 0.3), hidden


def test_torch_xla_checkpoint_inside_route_dropout_recomputes_the_forward_masks():
    """torch_xla's own checkpoint of a region entered inside route_dropout, backward() after the
    scope (autograd runs it outside every function mode): the recomputation is routed as its
    forward was, with its keys, whatever preserve_rng_state restores (torch_pallas.checkpointing)."""
    layer = make_layer()
    for preserve_rng_state in (True, False):
        with torch_pallas.route_dropout():
            step = lambda x: torch_xla.utils.checkpoint.checkpoint(routed_region, layer, x,  # noqa: E731
                                                                    preserve_rng_state=preserve_rng_state)
            layer.zero_grad()
            x = positive_input().requires_grad_()
            out, hidden = step(x)
        (out.square().sum() + hidden.sum()).backward()
        assert torch.equal((hidden != 0).cpu(), (x.grad != 0).cpu())
