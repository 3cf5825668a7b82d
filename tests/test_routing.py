"""route_dropout: functional dropout calls reach torch_pallas, eager and compiled."""

import warnings

import pytest
import torch
import torch.nn.functional as F
import torch_xla
import torch_xla.debug.metrics as met

import torch_pallas
from kernel_calls import record_dropout_keys


class FunctionalDropouts(torch.nn.Module):
    """Dropout as OPT and Llama write it (functional calls), plus one module."""

    def __init__(self):
        super().__init__()
        self.inner, self.outer = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
        self.module_dropout = torch.nn.Dropout(0.2)

    def forward(self, x):
        hidden = F.dropout(F.relu(self.inner(x)), p=0.1, training=self.training)
        hidden = torch.dropout(hidden, 0.1, self.training)
        hidden = self.module_dropout(hidden)
        return self.outer(hidden)


def model_and_input():
    torch.manual_seed(0)
    model = FunctionalDropouts().to(torch_xla.device())
    return model, torch.randn(32, 64).to(torch_xla.device())


def bernoullis(tensor):
    return torch_xla._XLAC._get_xla_tensors_text([tensor]).count("bernoulli")


def test_every_dropout_is_routed_and_torch_has_none_left():
    model, x = model_and_input()
    assert bernoullis(model(x)) == 3
    with torch_pallas.route_dropout():
        routed = model(x)
    assert bernoullis(routed) == 0


def test_routed_functional_dropout_is_torch_pallas_dropout():
    x = (torch.rand(16, 256) + 0.5).to(torch_xla.device())
    for call in (lambda: F.dropout(x, 0.3), lambda: torch.dropout(x, 0.3, True), lambda: torch.nn.Dropout(0.3)(x)):
        torch_xla.manual_seed(2)
        with torch_pallas.route_dropout():
            got = call()
        torch_xla.manual_seed(2)
        assert torch.equal(got.cpu(), torch_pallas.dropout(x, 0.3).cpu())
    with torch_pallas.route_dropout():
        assert F.dropout(x, 0.3, training=False) is x
        cpu = torch.ones(4)
        assert torch.equal(F.dropout(cpu, 0.0), cpu)  # other devices go to torch


def test_routed_channel_dropout_is_torch_pallas_channel_dropout():
    x = (torch.rand(4, 6, 5, 7) + 0.5).to(torch_xla.device())
    for call, ours in ((lambda: F.dropout2d(x, 0.3), torch_pallas.dropout2d),
                       (lambda: torch.nn.Dropout1d(0.3)(x[:, :, 0]), lambda x, p: torch_pallas.dropout1d(x[:, :, 0], p)),
                       (lambda: F.dropout3d(x, p=0.3), torch_pallas.dropout3d)):
        torch_xla.manual_seed(2)
        with torch_pallas.route_dropout():
            got = call()
        torch_xla.manual_seed(2)
        assert bernoullis(got) == 0 and torch.equal(got.cpu(), ours(x, 0.3).cpu())


def test_inplace_functional_dropout_writes_into_its_input():
    x = (torch.rand(16, 256) + 0.5).to(torch_xla.device())
    with torch_pallas.route_dropout():
        out = F.dropout(x, 0.5, inplace=True)
    assert out is x and (x == 0).any()


def test_compiled_model_under_routing_compiles_once():
    model, x = model_and_input()
    compiled = torch.compile(model, backend="openxla")
    counts = []
    with torch_pallas.route_dropout():
        for _ in range(4):
            compiled(x).sum().backward()
            torch_xla.sync()
            counts.append(met.metric_data("CompileTime")[0])
        assert counts[1] == counts[-1], counts


def test_fullgraph_openxla_compile_traces_the_routing_after_a_dict_mutation():
    """torch.compile(backend="openxla", fullgraph=True) of a model inside route_dropout, whose
    forward mutates a dict first (once inspect.signature's binding stopped dynamo there: "mapping
    proxy affected by dictionary mutation"), in eval mode (the identity) and training."""
    model, x = model_and_input()
    cache = {}

    def forward(x):
        cache["calls"] = cache.get("calls", 0) + 1
        return model(x)

    compiled = torch.compile(forward, backend="openxla", fullgraph=True)
    for training in (False, True):
        model.train(training)
        torch_xla.manual_seed(7)
        with torch_pallas.route_dropout():
            out = compiled(x)
        assert bernoullis(out) == 0
        if not training:
            torch.testing.assert_close(out.cpu(), model(x).cpu())


def test_attention_with_dropout_is_routed_and_the_rest_stays_torchs(monkeypatch):
    keys = record_dropout_keys(monkeypatch)
    q = torch.randn(2, 2, 8, 8, device=torch_xla.device())
    with torch_pallas.route_dropout():
        out = F.scaled_dot_product_attention(q, q, q, None, 0.1, is_causal=True)
        assert len(keys) == 1 and bernoullis(out) == 0
        F.scaled_dot_product_attention(q, q, q)  # no dropout: torch's
        assert len(keys) == 1
        with pytest.warns(UserWarning, match="dropout_p is applied by torch .* float32, bfloat16 and float16"):
            out = F.scaled_dot_product_attention(q.double(), q.double(), q.double(), dropout_p=0.1)
        assert bernoullis(out) == 1
        cpu = q.cpu()
        with pytest.warns(UserWarning, match="not on an accelerator device"):
            F.scaled_dot_product_attention(cpu, cpu, cpu, dropout_p=0.1)
    with torch_pallas.route_dropout(attention="all"):
        torch.testing.assert_close(F.scaled_dot_product_attention(q, q, q, scale=0.5),
                                   torch_pallas.scaled_dot_product_attention(q, q, q, scale=0.5))
        assert len(keys) == 1  # routed, with no dropout: no key drawn for a mask
    with torch_pallas.route_dropout(attention="none"), warnings.catch_warnings():
        warnings.simplefilter("error")  # asked for: no warning
        assert bernoullis(F.scaled_dot_product_attention(q, q, q, dropout_p=0.1)) == 1
    with pytest.raises(ValueError, match="attention must be one of"):
        torch_pallas.route_dropout(attention="some")


def test_convert_dropout_warns_when_it_finds_no_module():
    with pytest.warns(UserWarning, match="route_dropout"):
        torch_pallas.convert_dropout(torch.nn.Linear(2, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch_pallas.convert_dropout(FunctionalDropouts())


def test_cpu_tensors_are_routed_as_converted_modules_run_them():
    """docs/tensors.md, Plain CPU tensors: route_dropout and converted modules."""
    x = torch.rand(16, 256) + 0.5
    with torch_pallas.route_dropout():
        torch.manual_seed(4)
        routed = F.dropout(x, 0.3)
    module = torch_pallas.convert_dropout(torch.nn.Dropout(0.3)).train()
    torch.manual_seed(4)
    converted = module(x.requires_grad_())
    torch.manual_seed(4)
    assert torch.equal(routed, torch_pallas.dropout(x.detach(), 0.3)) and torch.equal(routed, converted.detach())
    converted.sum().backward()
    assert torch.equal(x.grad != 0, converted.detach() != 0)


def test_fusing_scopes_leave_meta_tensors_to_torch():
    """A model built or shape-checked on the meta device inside a fusing scope: its products,
    scalings, selections, fills and adds are torch's (nothing to fuse where nothing runs)."""
    q = torch.empty(2, 3, 16, 8, device="meta")
    with torch_pallas.route_dropout(fuse_residual=True, fuse_matmul=True):
        scores = torch.where(torch.ones(16, 16, dtype=torch.bool, device="meta"),
                             q @ q.transpose(-1, -2) / torch.full([], 8.0, device="meta"), float("-inf"))
        out = F.dropout(F.softmax(scores + scores, dim=-1), 0.5) @ q
    assert out.shape == (2, 3, 16, 8) and out.device.type == "meta"
