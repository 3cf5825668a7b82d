"""torch_pallas.sample_tokens on the xla stack: the kernel's tokens on XLA and CPU tensors, seeds as
ints or 64-bit tensors, a row's token alone and in a batch, compiled (fullgraph, no recompile for
new seeds and positions) equal to eager, the log-probabilities the kernel's, bad input."""

import numpy as np
import pytest
import torch
import torch_xla
import torch_xla.debug.metrics as met

import torch_pallas
from torch_pallas.kernels import token_sampling as token_sampling_kernels
from sampling_cases import check_continuations_alike_alone_in_a_batch_and_left_padded

BATCH, VOCABULARY = 6, 1000
SEEDS = [0, 1, 2**32, 2**63 + 5, 2**64 - 1, 12345]
POSITIONS = [0, 1, 7, 2**31, 2**32 - 1, 3]
PARAMETERS = dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02)


def logits(dtype=torch.float32):
    return (torch.randn(BATCH, VOCABULARY, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)


def kernel_tokens(values, seeds, positions, temperature, top_k=None, top_p=None, min_p=None) -> list[int]:
    words = np.array([[seed >> 32, seed & 0xFFFFFFFF] for seed in seeds], np.uint32).view(np.int32)

    def row(value, dtype):
        return None if value is None else np.full(len(seeds), value, dtype)
    tokens = token_sampling_kernels.sample_tokens(values.float().numpy(), words, np.array(positions, np.uint32),
                                                  row(temperature, np.float32), row(top_k, np.int32),
                                                  row(top_p, np.float32), row(min_p, np.float32), interpret=True)
    return np.asarray(tokens).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_xla_and_cpu_tensors_draw_the_kernels_tokens(dtype):
    values = logits(dtype)
    want = kernel_tokens(values, SEEDS, POSITIONS, **PARAMETERS)
    for device in ("cpu", torch_xla.device()):
        tokens = torch_pallas.sample_tokens(values.to(device), SEEDS, POSITIONS, **PARAMETERS)
        assert tokens.dtype == torch.int64 and tokens.device.type == torch.device(device).type
        assert tokens.cpu().tolist() == want


def test_seed_tensors_carry_all_64_bits_and_positions_their_low_32():
    values = logits().to(torch_xla.device())
    want = torch_pallas.sample_tokens(values, SEEDS, POSITIONS, **PARAMETERS).cpu()
    as_int64 = torch.tensor([seed - 2**64 if seed >= 2**63 else seed for seed in SEEDS])
    positions = torch.tensor(POSITIONS, dtype=torch.int64)
    for device in ("cpu", torch_xla.device()):
        got = torch_pallas.sample_tokens(values, as_int64.to(device), positions.to(device), **PARAMETERS)
        assert torch.equal(got.cpu(), want)


def test_per_row_parameters_and_a_rows_token_alone():
    """(B,) parameter tensors, each row as vLLM passes it; each row's token alone equals its token
    in the batch."""
    values = logits().to(torch_xla.device())
    per_row = dict(temperature=torch.tensor([0.0, 1.0, 0.5, 2.0, 1e-6, 0.7]), top_k=torch.tensor([0, 5, 0, 20, 1, 0]),
                   top_p=torch.tensor([1.0, 0.8, 0.95, 1.0, 0.5, 0.3]), min_p=torch.tensor([0, 0, 0.1, 0, 0, 0.05]))
    batch = torch_pallas.sample_tokens(values, SEEDS, POSITIONS, **{k: v.to(values.device) for k, v in per_row.items()})
    for b in range(BATCH):
        alone = torch_pallas.sample_tokens(values[b:b + 1], SEEDS[b:b + 1], POSITIONS[b:b + 1],
                                           **{k: v[b:b + 1].to(values.device) for k, v in per_row.items()})
        assert alone.cpu().item() == batch[b].cpu().item(), b
    greedy = [0, 4]
    assert batch.cpu()[greedy].tolist() == values.cpu().argmax(dim=1)[greedy].tolist()


def test_compiled_fullgraph_equals_eager_and_new_seeds_and_positions_do_not_recompile():
    values = logits().to(torch_xla.device())

    def step(values, seeds, positions):
        return torch_pallas.sample_tokens(values, seeds, positions, **PARAMETERS)
    compiled = torch.compile(step, backend="openxla", fullgraph=True)
    draws = []
    for i in range(3):
        seeds = torch.tensor(SEEDS[:3] * 2, dtype=torch.int64).add(i).to(values.device)
        positions = torch.tensor(POSITIONS, dtype=torch.int64).add(i).to(values.device)
        draws.append((compiled(values, seeds, positions).cpu(), step(values, seeds, positions).cpu()))
        torch_xla.sync()
        if i == 0:
            compiles = met.metric_data("CompileTime")[0]
    assert met.metric_data("CompileTime")[0] == compiles, "new seeds or positions compiled a new XLA graph"
    assert all(torch.equal(compiled_tokens, eager) for compiled_tokens, eager in draws)
    assert not torch.equal(draws[0][0], draws[1][0]), "the same tokens for other seeds and positions"


def test_logprobs_are_the_kernels_on_xla_and_cpu_tensors_eager_and_compiled():
    values = logits()
    words = np.array([[seed >> 32, seed & 0xFFFFFFFF] for seed in SEEDS], np.uint32).view(np.int32)
    parameters = {name: np.full(BATCH, value, np.int32 if name == "top_k" else np.float32)
                  for name, value in PARAMETERS.items()}
    want = token_sampling_kernels.sample_tokens(values.numpy(), words, np.array(POSITIONS, np.uint32),
                                                interpret=True, with_logprobs=True, **parameters)

    def step(values, seeds, positions):
        return torch_pallas.sample_tokens(values, seeds, positions, **PARAMETERS, return_logprobs=True)
    seeds = torch.tensor([seed - 2**64 if seed >= 2**63 else seed for seed in SEEDS])
    positions = torch.tensor(POSITIONS, dtype=torch.int64)
    device = torch_xla.device()
    compiled = torch.compile(step, backend="openxla", fullgraph=True)
    for got in (step(values, SEEDS, POSITIONS), step(values.to(device), SEEDS, POSITIONS),
                compiled(values.to(device), seeds.to(device), positions.to(device))):
        assert isinstance(got, torch_pallas.token_sampling.SampledTokens)
        assert got.tokens.dtype == torch.int64 and got.logprobs.dtype == got.raw_logprobs.dtype == torch.float32
        assert got.tokens.cpu().tolist() == np.asarray(want[0]).tolist()
        np.testing.assert_allclose(got.logprobs.cpu().numpy(), np.asarray(want[1]), atol=1e-6)
        np.testing.assert_allclose(got.raw_logprobs.cpu().numpy(), np.asarray(want[2]), atol=1e-6)
    assert torch.equal(step(values, SEEDS, POSITIONS).tokens, torch_pallas.sample_tokens(values, SEEDS, POSITIONS,
                                                                                          **PARAMETERS))


def test_inductor_compiles_cpu_tensors_fullgraph():
    values = logits()
    compiled = torch.compile(lambda v, s, p: torch_pallas.sample_tokens(v, s, p, **PARAMETERS), fullgraph=True)
    seeds, positions = torch.tensor(SEEDS[:3] * 2, dtype=torch.int64), torch.tensor(POSITIONS, dtype=torch.int64)
    assert torch.equal(compiled(values, seeds, positions), torch_pallas.sample_tokens(values, seeds, positions,
                                                                                       **PARAMETERS))


def test_an_empty_batch():
    assert torch_pallas.sample_tokens(torch.zeros(0, 10), [], []).shape == (0,)
    assert [t.shape for t in torch_pallas.sample_tokens(torch.zeros(0, 10), [], [], return_logprobs=True)] == [(0,)] * 3


@pytest.mark.parametrize("call,error,match", [
    (lambda v: torch_pallas.sample_tokens(v.long(), SEEDS, POSITIONS), TypeError, "logits must be"),
    (lambda v: torch_pallas.sample_tokens(v[0], SEEDS, POSITIONS), ValueError, "logits must be 2-D"),
    (lambda v: torch_pallas.sample_tokens(v, SEEDS[:2], POSITIONS), ValueError, "seeds must have 6 values"),
    (lambda v: torch_pallas.sample_tokens(v, [-1] + SEEDS[1:], POSITIONS), ValueError, r"seeds must be in \[0, 2\*\*64\)"),
    (lambda v: torch_pallas.sample_tokens(v, torch.zeros(6), POSITIONS), TypeError, "seeds must hold integers"),
    (lambda v: torch_pallas.sample_tokens(v, SEEDS, torch.zeros(5, dtype=torch.int64)), ValueError,
     r"positions must have shape \(6,\)"),
    (lambda v: torch_pallas.sample_tokens(v, SEEDS, [2**32] * 6), ValueError, r"positions must be in \[0, 2\*\*32\)"),
    (lambda v: torch_pallas.sample_tokens(v, SEEDS, POSITIONS, temperature=-0.5), ValueError, "temperature must be in"),
    (lambda v: torch_pallas.sample_tokens(v, SEEDS, POSITIONS, top_k=-1), ValueError, r"top_k must be in \[0, inf\]"),
    (lambda v: torch_pallas.sample_tokens(v, SEEDS, POSITIONS, top_k=2.5), TypeError, "top_k must be an int"),
    (lambda v: torch_pallas.sample_tokens(v, SEEDS, POSITIONS, top_p=0.0), ValueError, r"top_p must be in \(0, 1\]"),
    (lambda v: torch_pallas.sample_tokens(v, SEEDS, POSITIONS, top_p=float("nan")), ValueError, "top_p must be in"),
    (lambda v: torch_pallas.sample_tokens(v, SEEDS, POSITIONS, min_p=1.5), ValueError, r"min_p must be in \[0, 1\]"),
    (lambda v: torch_pallas.sample_tokens(v, SEEDS, POSITIONS, top_p=torch.ones(3)), ValueError,
     r"top_p must be a number or have shape \(6,\)"),
    (lambda v: torch_pallas.sample_tokens(v, SEEDS, POSITIONS, top_k=torch.ones(6)), TypeError,
     "top_k must hold integers"),
    (lambda v: torch_pallas.sample_tokens(v, SEEDS, POSITIONS, return_logprobs=1), TypeError,
     "return_logprobs must be a bool"),
])
def test_bad_input_names_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call(logits())


# (on the XLA device every step of every call compiles a graph of its own length: 3.5 minutes)
@pytest.mark.parametrize("device", ["cpu", pytest.param("xla", marks=pytest.mark.slow)])
def test_generate_continues_a_prompt_alike_alone_in_a_batch_and_left_padded(device):
    """docs/sampling.md, transformers: SeededSampling in generate(do_sample=True)."""
    check_continuations_alike_alone_in_a_batch_and_left_padded(
        torch_xla.device() if device == "xla" else torch.device("cpu"))
