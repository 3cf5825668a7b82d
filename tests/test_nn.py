"""torch_pallas.nn: Dropout as a drop-in nn.Dropout, convert_dropout, and compiled training."""

import pytest
import torch
import torch_xla
import torch_xla.debug.metrics as met

import torch_pallas
from torch_pallas.nn import Dropout, convert_dropout


def xla(t):
    return t.to(torch_xla.device())


def test_dropout_module_behaves_like_torch():
    module = Dropout(0.25)
    assert repr(module) == "Dropout(p=0.25)"
    assert repr(Dropout(0.1, impl="threefry")) == "Dropout(p=0.1, impl='threefry')"
    x = xla(torch.ones(16, 256))
    assert module.training
    y = module(x).cpu()
    assert set(y.unique().tolist()) <= {0.0, torch.tensor(1 / 0.75).item()} and (y == 0).any()
    module.eval()
    assert module(x) is x


@pytest.mark.parametrize("p,error", [(1.5, ValueError), (float("nan"), ValueError), ("0.5", TypeError)])
def test_dropout_module_rejects_bad_p(p, error):
    with pytest.raises(error, match="p must"):
        Dropout(p)


def test_convert_dropout_replaces_nested_modules_in_place():
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 4), torch.nn.Dropout(0.2),
        torch.nn.Sequential(torch.nn.Dropout(0.1, inplace=True), torch.nn.Dropout2d(0.3)),
        torch.nn.ModuleDict({"inner": torch.nn.Dropout(0.4)}),
    )
    model[2][0].eval()
    same = convert_dropout(model)
    assert same is model
    assert type(model[1]) is Dropout and model[1].p == 0.2
    assert type(model[2][0]) is Dropout and model[2][0].p == 0.1 and not model[2][0].training
    assert type(model[2][1]) is torch.nn.Dropout2d
    assert type(model[3]["inner"]) is Dropout and model[3]["inner"].p == 0.4
    assert type(convert_dropout(torch.nn.Dropout(0.3))) is Dropout


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Dropout(0.3),
            torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(128, 1))

    def forward(self, x):
        return self.net(x)


def test_compiled_training_loop_compiles_once_and_draws_fresh_masks():
    torch.manual_seed(0)
    model = convert_dropout(MLP()).to(torch_xla.device())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, target = xla(torch.randn(32, 64)), xla(torch.randn(32, 1))

    def forward(inputs):
        activation = model.net[:2](inputs)
        hidden = model.net[2](activation)  # the first dropout
        return model.net[3:](hidden), activation, hidden

    compiled = torch.compile(forward, backend="openxla", fullgraph=True)

    def step():
        optimizer.zero_grad()
        prediction, activation, hidden = compiled(x)
        loss = torch.nn.functional.mse_loss(prediction, target)
        loss.backward()
        optimizer.step()
        active = activation > 0  # a dropped unit is zero, and so is a ReLU-inactive one
        kept = (hidden != 0) & active
        torch_xla.sync()
        return kept.sum().item() / active.sum().item(), kept.cpu()

    for _ in range(2):  # warm-up: dynamo traces, XLA compiles forward, backward and the update
        step()
    compiles = met.metric_data("CompileTime")[0]
    keep_fractions, masks = zip(*(step() for _ in range(5)))
    assert met.metric_data("CompileTime")[0] == compiles, "a training step compiled a new XLA graph"
    assert all(not torch.equal(a, b) for a, b in zip(masks, masks[1:])), "a mask repeated"
    assert all(abs(fraction - 0.7) < 0.05 for fraction in keep_fractions), keep_fractions


def _seeded(x):
    return torch_pallas.dropout(x * 2, p=0.4, seed=2**63 + 1) + 1


def test_compiled_explicit_seed_equals_eager():
    x = xla(torch.randn(32, 256))
    compiled = torch.compile(_seeded, backend="openxla", fullgraph=True)
    assert torch.equal(compiled(x).cpu(), _seeded(x).cpu())
    assert torch.equal(compiled(x).cpu(), _seeded(x).cpu())
