"""torch_pallas.nn: Dropout as a drop-in nn.Dropout, convert_dropout, and compiled training."""

import pytest
import torch
import torch_xla
import torch_xla.debug.metrics as met

import torch_pallas
from reference import indrnn_reference
from torch_pallas.nn import Dropout, IndRNN, convert_dropout


def xla(t):
    return t.to(torch_xla.device())


def test_dropout_module_behaves_like_torch():
    module = Dropout(0.25)
    assert repr(module) == repr(torch.nn.Dropout(0.25)) == "Dropout(p=0.25, inplace=False)"
    assert repr(Dropout(0.1, impl="threefry")) == "Dropout(p=0.1, inplace=False, impl='threefry')"
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


def test_dropout_module_is_a_torch_dropout_with_its_signature():
    assert isinstance(Dropout(), torch.nn.Dropout) and Dropout().p == 0.5 and not Dropout().inplace
    positional, keyword = Dropout(0.3, True), Dropout(p=0.3, inplace=True)
    assert positional.inplace and keyword.inplace and positional.p == keyword.p == 0.3


def test_inplace_dropout_writes_into_its_input_and_keeps_its_gradient():
    base = xla(torch.rand(16, 256) + 0.5).requires_grad_()
    x = base * 1  # a non-leaf: torch allows in-place ops only there
    out = Dropout(0.5, inplace=True)(x)
    assert out is x and (out == 0).any()
    out.sum().backward()
    torch.testing.assert_close(base.grad.cpu(), (out.detach().cpu() != 0).float() * 2, rtol=0, atol=0)


@pytest.mark.parametrize("ours,theirs", [(torch_pallas.nn.Dropout1d, torch.nn.Dropout1d),
                                         (torch_pallas.nn.Dropout2d, torch.nn.Dropout2d),
                                         (torch_pallas.nn.Dropout3d, torch.nn.Dropout3d)])
def test_channel_dropout_modules_are_torch_modules_with_torch_signatures(ours, theirs):
    module = ours(0.3, True)
    assert isinstance(module, theirs) and repr(module) == repr(theirs(0.3, True))
    assert ours().p == 0.5 and not ours().inplace and "impl='threefry'" in repr(ours(impl="threefry"))
    spatial_dims = int(theirs.__name__[-2])
    x = xla(torch.rand((2, 8) + (4,) * spatial_dims) + 0.5)
    torch_xla.manual_seed(1)
    got = ours(0.5)(x)
    torch_xla.manual_seed(1)
    assert torch.equal(got.cpu(), getattr(torch_pallas, theirs.__name__.lower())(x, 0.5).cpu())
    assert ours(0.5).eval()(x) is x


def test_eval_is_the_identity_on_any_device_and_dtype():
    module = Dropout(0.5).eval()
    for tensor in (torch.ones(3), torch.arange(4), xla(torch.arange(4))):
        assert module(tensor) is tensor
        assert torch_pallas.dropout(tensor, 0.5, training=False) is tensor


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
    assert model[2][0].inplace and not model[1].inplace
    assert type(model[2][1]) is torch_pallas.nn.Dropout2d and model[2][1].p == 0.3
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
    """docs/tour-xla.md, torch.compile: compiles without graph breaks (fullgraph); a new key per step
    causes no recompile."""
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


# --- IndRNN ---------------------------------------------------------------------------

def module_reference(module, x, hx):
    """The module's computation in float64 on the CPU, from its own parameters."""
    parameters = {name: p.detach().cpu().double() for name, p in module.named_parameters()}
    sequence = x.double()
    states = []
    for layer in range(module.num_layers):
        outputs = []
        for direction, suffix in enumerate([f"_l{layer}", f"_l{layer}_reverse"][:module.num_directions]):
            projected = sequence @ parameters[f"weight_ih{suffix}"].T + parameters.get(f"bias_ih{suffix}", 0)
            if direction:
                projected = projected.flip(0)
            output, h_n = map(torch.from_numpy, indrnn_reference(
                projected, parameters[f"weight_hh{suffix}"], hx[layer * module.num_directions + direction],
                module.nonlinearity))
            outputs.append(output.flip(0) if direction else output)
            states.append(h_n)
        sequence = torch.cat(outputs, dim=-1)
    return sequence, torch.stack(states)


@pytest.mark.parametrize("options", [
    dict(num_layers=2, bidirectional=True),
    dict(num_layers=1, nonlinearity="tanh", bias=False),
])
def test_indrnn_module_matches_float64_reference(options):
    torch.manual_seed(0)
    module = IndRNN(6, 130, **options).to(torch_xla.device())
    x = torch.randn(11, 3, 6)
    hx = torch.randn(module.num_layers * module.num_directions, 3, 130)
    output, h_n = module(xla(x), xla(hx))
    expected_output, expected_h_n = module_reference(module, x, hx)
    assert output.shape == (11, 3, 130 * module.num_directions)
    assert h_n.shape == (module.num_layers * module.num_directions, 3, 130)
    torch.testing.assert_close(output.cpu().double(), expected_output, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h_n.cpu().double(), expected_h_n, rtol=1e-5, atol=1e-5)


def test_indrnn_module_batch_first_and_unbatched():
    torch.manual_seed(0)
    module = IndRNN(6, 130, batch_first=True).to(torch_xla.device())
    x = torch.randn(3, 11, 6)
    output, h_n = module(xla(x))
    expected, expected_h_n = module_reference(module, x.transpose(0, 1), torch.zeros(1, 3, 130))
    torch.testing.assert_close(output.cpu().double(), expected.transpose(0, 1), rtol=1e-5, atol=1e-5)
    single, single_h_n = module(xla(x[0]))  # unbatched: (T, features)
    assert single.shape == (11, 130) and single_h_n.shape == (1, 130)
    torch.testing.assert_close(single.cpu(), output[0].cpu(), rtol=1e-6, atol=1e-6)


def test_indrnn_module_initialisation_repr_and_clipping():
    module = IndRNN(4, 256, num_layers=2, recurrent_max_abs=0.5, dropout=0.1)
    assert repr(module) == "IndRNN(4, 256, num_layers=2, dropout=0.1, recurrent_max_abs=0.5)"
    for weight in module.recurrent_weights():
        assert weight.min() >= 0 and weight.max() <= 0.5  # U(0, 1), clipped
    assert abs(module.weight_ih_l0).max() <= 1 / 256**0.5
    module.to(torch_xla.device())
    optimizer = torch.optim.SGD(module.parameters(), lr=100.0)
    handle = module.clip_after(optimizer)
    output, _ = module(xla(torch.randn(5, 2, 4)))
    output.sum().backward()
    optimizer.step()
    for weight in module.recurrent_weights():
        assert weight.abs().max().item() <= 0.5
    handle.remove()


class RecordDropout(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the input and output of every torch_pallas::dropout op that runs."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func is torch.ops.torch_pallas.dropout.default:
            self.calls.append((args[0].detach().cpu(), result.detach().cpu()))
        return result


def test_indrnn_dropout_mask_is_shared_over_time():
    torch.manual_seed(0)
    module = IndRNN(4, 128, num_layers=2, dropout=0.5).to(torch_xla.device())
    with RecordDropout() as recorder:
        module(xla(torch.rand(6, 3, 4)))
    dropped = recorder.calls
    (before, after), = dropped
    kept = (after != 0) | (before == 0)  # a ReLU-zero unit is neither kept nor dropped
    dropped_units = (after == 0) & (before != 0)
    assert dropped_units.any() and kept.any()
    for t in range(1, 6):  # a unit dropped at one time step is dropped at every one where it fires
        both_active = (before[t] != 0) & (before[0] != 0)
        assert torch.equal((after[t] != 0)[both_active], (after[0] != 0)[both_active])
    module.eval()
    with RecordDropout() as recorder:
        module(xla(torch.rand(6, 3, 4)))
    assert not recorder.calls, "dropout ran in eval mode"


def test_indrnn_dropout_takes_the_default_impl_or_its_own():
    """nn.IndRNN(impl=...): its dropout's generator, the default's (tiled) without one."""
    x = xla(torch.rand(6, 3, 4))
    masks = {}
    for impl in (None, "tiled", "threefry"):
        torch.manual_seed(0)
        module = IndRNN(4, 128, num_layers=2, dropout=0.5, impl=impl).to(torch_xla.device())
        torch_xla.manual_seed(1)
        with RecordDropout() as recorder:
            module(x)
        (_, after), = recorder.calls
        masks[impl] = after != 0
    assert torch.equal(masks[None], masks["tiled"]) and not torch.equal(masks["tiled"], masks["threefry"])
    assert repr(IndRNN(4, 8, impl="threefry")) == "IndRNN(4, 8, impl='threefry')"


@pytest.mark.parametrize("bad,error", [
    (dict(input_size=0), ValueError), (dict(hidden_size=-1), ValueError), (dict(num_layers=1.5), TypeError),
    (dict(hidden_size="8"), TypeError), (dict(nonlinearity="gelu"), ValueError), (dict(dropout=1.5), ValueError),
    (dict(recurrent_max_abs=0.0), ValueError), (dict(recurrent_max_abs=float("inf")), ValueError),
    (dict(impl="philox"), ValueError),
])
def test_indrnn_module_rejects_bad_arguments(bad, error):
    """A value of the wrong type is a TypeError, one out of range a ValueError, as across torch_pallas."""
    arguments = dict(input_size=4, hidden_size=8) | bad
    with pytest.raises(error):
        IndRNN(**arguments)


def test_indrnn_module_rejects_bad_input():
    module = IndRNN(4, 8).to(torch_xla.device())
    with pytest.raises(ValueError, match="4 features"):
        module(xla(torch.zeros(5, 2, 3)))
    with pytest.raises(ValueError, match="2-D .* or 3-D"):
        module(xla(torch.zeros(5)))
    with pytest.raises(ValueError, match=r"hx must have shape \(1, 2, 8\)"):
        module(xla(torch.zeros(5, 2, 4)), xla(torch.zeros(2, 8)))
    with pytest.raises(ValueError, match="input is on cpu but the module's parameters are on xla"):
        module(torch.zeros(5, 2, 4))
    with pytest.raises(ValueError, match="input is on xla:0 but the module's parameters are on cpu"):
        IndRNN(4, 8)(xla(torch.zeros(5, 2, 4)))
    with pytest.raises(TypeError, match="a torch.Tensor or a PackedSequence"):
        module([torch.zeros(3, 4)])


def torch_rnn_error(*arguments):
    """The exception type torch.nn.RNN(4, 8) raises on the CPU for these arguments."""
    try:
        torch.nn.RNN(4, 8)(*arguments)
    except Exception as error:  # noqa: BLE001  (whatever torch raises is the reference)
        return type(error)
    raise AssertionError(f"torch.nn.RNN accepted {[tuple(a.shape) for a in arguments]}")


@pytest.mark.parametrize("options", [dict(num_layers=2, bidirectional=True), dict(bias=False)],
                         ids=["two bidirectional layers", "no bias"])
def test_indrnn_all_weights_and_flatten_parameters_as_nn_rnn(options):
    module = IndRNN(4, 8, **options)
    theirs = torch.nn.RNN(4, 8, **options)
    # nn.RNN's order, without the bias_hh IndRNN does not have
    assert module._all_weights == [[name for name in names if not name.startswith("bias_hh")]
                                   for names in theirs._all_weights]
    flat = sum(module.all_weights, [])
    assert sorted(map(id, flat)) == sorted(map(id, module.parameters()))  # the parameters themselves, each once
    assert module.all_weights[0][0] is module.weight_ih_l0 and module.all_weights[0][1] is module.weight_hh_l0
    assert [tuple(p.shape) for p in module.all_weights[0]] == [(8, 4), (8,)] + ([(8,)] if module.bias else [])
    before = [p.detach().clone() for p in module.parameters()]
    assert module.flatten_parameters() is None
    assert all(torch.equal(p, q) for p, q in zip(before, module.parameters()))


@pytest.mark.parametrize("input_dtype,hx_dtype", [
    (torch.bfloat16, None), (torch.long, None), (torch.float64, None), (torch.float32, torch.bfloat16),
    (torch.float32, torch.float64),
])
def test_indrnn_rejects_dtypes_other_than_the_parameters_as_nn_rnn(input_dtype, hx_dtype):
    x = torch.ones(5, 2, 4, dtype=input_dtype)
    hx = None if hx_dtype is None else torch.zeros(1, 2, 8, dtype=hx_dtype)
    expected = torch_rnn_error(*[t for t in (x, hx) if t is not None])  # ValueError for input, RuntimeError hx
    name, dtype = ("input", input_dtype) if hx is None else ("hx", hx_dtype)
    with pytest.raises(expected, match=f"{name} must have the type torch.float32, got type {dtype}") as error:
        IndRNN(4, 8).to(torch_xla.device())(xla(x), None if hx is None else xla(hx))
    # a dtype error is a TypeError across torch_pallas, and also what nn.RNN raises
    assert isinstance(error.value, TypeError) and isinstance(error.value, ValueError)


def test_indrnn_under_autocast_accepts_other_float_dtypes_but_not_token_ids():
    module = IndRNN(4, 8).to(torch_xla.device())
    with torch.autocast("xla", dtype=torch.bfloat16):  # nn.RNN skips its dtype check under autocast too
        output, h_n = module(xla(torch.ones(5, 2, 4, dtype=torch.bfloat16)), xla(torch.zeros(1, 2, 8)))
        assert output.shape == (5, 2, 8) and output.dtype == h_n.dtype == torch.bfloat16
        with pytest.raises(ValueError, match="got type torch.int64 .token ids"):
            module(xla(torch.ones(5, 2, 4, dtype=torch.long)))


@pytest.mark.parametrize("batch_first", [False, True])
def test_indrnn_rejects_an_empty_sequence_and_accepts_an_empty_batch_as_nn_rnn(batch_first):
    module = IndRNN(4, 8, batch_first=batch_first).to(torch_xla.device())
    empty_sequences = [torch.zeros(2, 0, 4) if batch_first else torch.zeros(0, 2, 4), torch.zeros(0, 4)]
    for x in empty_sequences:
        expected = torch_rnn_error(x.transpose(0, 1) if batch_first and x.dim() == 3 else x)
        with pytest.raises(expected, match="at least one time step") as error:
            module(xla(x))
        assert expected is RuntimeError and isinstance(error.value, ValueError)
    no_batch = torch.zeros(0, 5, 4) if batch_first else torch.zeros(5, 0, 4)
    output, h_n = module(xla(no_batch))
    theirs, their_h_n = torch.nn.RNN(4, 8, batch_first=batch_first)(no_batch)
    assert output.shape == theirs.shape and h_n.shape == their_h_n.shape


# Two bidirectional layers compile a kernel pair per direction, layer and length: slow
# (./dev test --slow runs it); the one-layer case is in the default run.
@pytest.mark.parametrize("options", [dict(), pytest.param(dict(num_layers=2, bidirectional=True, nonlinearity="tanh"),
                                                          marks=pytest.mark.slow)],
                         ids=["one layer", "two bidirectional layers"])
def test_indrnn_module_on_a_packed_batch_equals_each_sequence_run_alone(options):
    """As nn.RNN: each sequence stops at its own length, h_n is its last state, the reverse
    direction starts at its last step, and gradients reach only its own steps."""
    torch.manual_seed(0)
    module = IndRNN(3, 130, **options).to(torch_xla.device())
    sequences = [torch.randn(length, 3) for length in (5, 2, 7, 2)]
    hx = torch.randn(module.num_layers * module.num_directions, 4, 130)
    leaves = [sequence.clone().requires_grad_() for sequence in sequences]
    packed = torch.nn.utils.rnn.pack_sequence(leaves, enforce_sorted=False).to(torch_xla.device())
    output, h_n = module(packed, xla(hx))
    assert isinstance(output, torch.nn.utils.rnn.PackedSequence)
    assert torch.equal(output.batch_sizes, packed.batch_sizes)
    (output.data.sum() + h_n.sum()).backward()
    packed_weight_grad = module.weight_hh_l0.grad.cpu().clone()
    padded, lengths = torch.nn.utils.rnn.pad_packed_sequence(output)
    assert lengths.tolist() == [5, 2, 7, 2] and not padded[2:, 1].cpu().any()  # zero padding
    module.zero_grad()
    for b, sequence in enumerate(sequences):
        alone = xla(sequence).requires_grad_()
        expected, expected_h_n = module(alone.unsqueeze(1), xla(hx[:, b:b + 1].contiguous()))
        (expected.sum() + expected_h_n.sum()).backward()
        torch.testing.assert_close(padded[:len(sequence), b].cpu(), expected[:, 0].cpu(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(h_n[:, b].cpu(), expected_h_n[:, 0].cpu(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(leaves[b].grad, alone.grad.cpu(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(packed_weight_grad, module.weight_hh_l0.grad.cpu(), rtol=1e-5, atol=1e-5)


def test_pack_padded_sequence_is_torchs_on_xla_tensors():
    padded = torch.randn(7, 4, 3, requires_grad=True)
    for lengths, enforce_sorted, batch_first in (([7, 5, 2, 2], True, False), ([2, 7, 5, 2], False, True)):
        source = padded.transpose(0, 1) if batch_first else padded
        expected = torch.nn.utils.rnn.pack_padded_sequence(source, lengths, batch_first, enforce_sorted)
        got = torch_pallas.packing.pack_padded_sequence(xla(source), lengths, batch_first, enforce_sorted)
        assert torch.equal(got.data.cpu(), expected.data) and torch.equal(got.batch_sizes, expected.batch_sizes)
        assert (got.sorted_indices is None) == enforce_sorted
        cotangent = torch.randn_like(expected.data)
        torch.testing.assert_close(torch.autograd.grad(got.data, padded, xla(cotangent))[0],
                                   torch.autograd.grad(expected.data, padded, cotangent)[0], rtol=0, atol=0)
    with pytest.raises(ValueError, match="decreasing"):
        torch_pallas.packing.pack_padded_sequence(xla(padded), [2, 7, 5, 2])
    with pytest.raises(ValueError, match=r"lengths must be in \[1, 7\]"):
        torch_pallas.packing.pack_padded_sequence(xla(padded), [8, 7, 5, 2])


class SequenceRegressor(torch.nn.Module):
    """IndRNN over a sequence, a linear read-out of the last step."""

    def __init__(self):
        super().__init__()
        self.rnn = IndRNN(2, 64, num_layers=2, dropout=0.1, recurrent_max_abs=1.0)
        self.readout = torch.nn.Linear(64, 1)

    def forward(self, x):
        output, _ = self.rnn(x)
        return self.readout(output[-1])


def test_indrnn_trains_under_compile_with_one_compile():
    torch.manual_seed(0)
    # The task: the mean of the first channel over time, where the second channel is noise.
    x = torch.rand(20, 64, 2)
    target = x[:, :, :1].mean(0)
    model = SequenceRegressor().to(torch_xla.device())
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.rnn.clip_after(optimizer)
    compiled = torch.compile(model, backend="openxla", fullgraph=True)
    x, target = xla(x), xla(target)

    def step():
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(compiled(x), target)
        loss.backward()
        optimizer.step()
        torch_xla.sync()
        return loss.item()

    losses = [step() for _ in range(3)]  # warm-up
    compiles = met.metric_data("CompileTime")[0]
    losses += [step() for _ in range(57)]
    assert met.metric_data("CompileTime")[0] == compiles, "a training step compiled a new XLA graph"
    assert sum(losses[-5:]) / 5 < 0.3 * losses[0], losses
