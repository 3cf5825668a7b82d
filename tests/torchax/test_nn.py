"""torch_pallas.nn's dropout modules, convert_dropout, route_dropout and torch_pallas.checkpoint on
torchax tensors: the same masks as the functions for the same key, gradients through them."""

import numpy as np
import jax
import pytest
import torch
import torch.nn.functional as F

import torch_pallas
from reference import SEEDS, jax_key
from torch_pallas import seeds
from torchax_support import ENV, SHAPE, in_env, jax_tensor, numpy, positive, square_weight  # noqa: F401  (in_env: fixture)

pytestmark = pytest.mark.usefixtures("in_env")

FEATURES = SHAPE[1]


class Block(torch.nn.Module):
    """Two dropouts: a module and F.dropout in forward (the form route_dropout reroutes).
    x @ weight rather than nn.Linear: torchax runs F.linear above torch's autograd."""

    def __init__(self):
        super().__init__()
        self.weight = square_weight(FEATURES)
        self.dropout = torch.nn.Dropout(0.5)

    def forward(self, x):
        hidden = self.dropout(torch.relu(x))
        return F.dropout(torch.tanh(hidden @ self.weight), 0.3, self.training), hidden


def keyed(key, function, *args):
    with seeds.key_scope(key):
        return function(*args)


def test_modules_draw_the_functions_masks_and_eval_is_the_identity():
    """docs/tour-xla.md, Modules (on torchax tensors): torch_pallas.nn.Dropout* are the functions as modules."""
    x4 = positive((4, 6, 5, 7))
    key = seeds.key_data(seed=SEEDS[2])
    for module, function in ((torch_pallas.nn.Dropout(0.3), lambda t: torch_pallas.dropout(t, 0.3)),
                             (torch_pallas.nn.Dropout2d(0.3), lambda t: torch_pallas.dropout2d(t, 0.3)),
                             (torch_pallas.nn.Dropout3d(0.3), lambda t: torch_pallas.dropout3d(t, 0.3))):
        np.testing.assert_array_equal(numpy(keyed(key, module, x4)), numpy(keyed(key, function, x4)))
        assert module.eval()(x4) is x4
    x3 = positive((4, 6, 33))
    np.testing.assert_array_equal(numpy(keyed(key, torch_pallas.nn.Dropout1d(0.5), x3)),
                                  numpy(keyed(key, lambda t: torch_pallas.dropout1d(t, 0.5), x3)))
    keep = np.asarray(jax.random.bernoulli(jax.random.fold_in(jax_key(SEEDS[2]), 0), 0.7, (4, 6, 5, 7)))
    np.testing.assert_array_equal(numpy(keyed(key, torch_pallas.nn.Dropout(0.3, impl="threefry"), x4)) != 0, keep)


def test_convert_dropout_and_route_dropout_give_the_same_model_the_same_masks():
    """docs/transformers.md, Routing: convert_dropout swaps the modules, route_dropout reroutes F.dropout
    as well; for one key both draw what the functions draw, in the same order."""
    x = positive((4, FEATURES))
    key = seeds.key_data(seed=SEEDS[1])

    def by_hand(x):
        hidden = torch_pallas.dropout(torch.relu(x), 0.5)
        return torch_pallas.dropout(torch.tanh(hidden @ model.weight), 0.3), hidden

    model = Block().to("jax")
    with torch_pallas.route_dropout():
        routed = keyed(key, model, x)
    expected = keyed(key, by_hand, x)
    for got, want in zip(routed, expected):
        np.testing.assert_array_equal(numpy(got), numpy(want))
    torch_pallas.convert_dropout(model)
    assert isinstance(model.dropout, torch_pallas.nn.Dropout)
    converted_hidden = keyed(key, model, x)[1]  # F.dropout (unrouted) is torchax's own
    np.testing.assert_array_equal(numpy(converted_hidden), numpy(expected[1]))


def run(step, model):
    """One forward and backward on a positive x: (forward mask, the mask x's gradient saw, weight grad)."""
    model.zero_grad()
    x = positive((4, FEATURES), requires_grad=True)  # reentrant checkpointing needs an input with grad
    out, hidden = step(x)
    (out.square().sum() + hidden.sum()).backward()
    return numpy(hidden) != 0, numpy(x.grad) != 0, numpy(model.weight.grad)


def test_checkpoint_recomputes_the_forward_masks_and_equals_the_region_without_it():
    """docs/transformers.md, Checkpointing: the recomputation draws the forward's noise;
    gradients equal the unchekpointed region's for the key the checkpoint draws."""
    model = Block().to("jax")

    def checkpointed(x):
        with torch_pallas.route_dropout():
            return torch_pallas.checkpoint(model, x)

    ENV.manual_seed(5)
    got = run(checkpointed, model)
    np.testing.assert_array_equal(got[0], got[1])
    ENV.manual_seed(5)
    key = seeds.key_data()  # the key checkpoint draws first

    def plain(x):
        with torch_pallas.route_dropout():
            return keyed(key, model, x)

    want = run(plain, model)
    assert np.abs(want[2]).sum() > 0
    for got_part, want_part in zip(got, want):
        np.testing.assert_array_equal(got_part, want_part)
    assert not np.array_equal(run(checkpointed, model)[0], got[0]), "each call draws a fresh key"
