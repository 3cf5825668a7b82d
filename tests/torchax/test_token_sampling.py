"""torch_pallas.sample_tokens on torchax's ``jax`` device: the kernel's tokens (and log-probabilities),
as on CPU tensors, for seeds as ints and as CPU int64 tensors (torchax's own int64 tensors hold 32 bits: JAX runs
without x64)."""

import pytest
import torch

import torch_pallas
from sampling_cases import check_continuations_alike_alone_in_a_batch_and_left_padded
from torchax_support import in_env  # noqa: F401  (in_env: fixture)

pytestmark = pytest.mark.usefixtures("in_env")

SEEDS = [0, 2**63 + 5, 2**64 - 1, 12345]
POSITIONS = [0, 2**31, 2**32 - 1, 3]
PARAMETERS = dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_jax_device_draws_the_cpu_tensors_tokens(dtype):
    values = (torch.randn(4, 1000, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    want = torch_pallas.sample_tokens(values, SEEDS, POSITIONS, **PARAMETERS)
    seeds = torch.tensor([seed - 2**64 if seed >= 2**63 else seed for seed in SEEDS])
    for seed_values in (SEEDS, seeds):
        got = torch_pallas.sample_tokens(values.to("jax"), seed_values, POSITIONS, **PARAMETERS)
        # (torchax's int64 is int32 without x64)
        assert got.device.type == "jax" and got.dtype == torch.zeros(1, dtype=torch.int64, device="jax").dtype
        assert got.cpu().tolist() == want.tolist()


def test_the_jax_device_returns_the_cpu_tensors_logprobs():
    values = torch.randn(4, 1000, generator=torch.Generator().manual_seed(1)) * 3
    want = torch_pallas.sample_tokens(values, SEEDS, POSITIONS, **PARAMETERS, return_logprobs=True)
    got = torch_pallas.sample_tokens(values.to("jax"), SEEDS, POSITIONS, **PARAMETERS, return_logprobs=True)
    assert got.tokens.cpu().tolist() == want.tokens.tolist()
    torch.testing.assert_close(got.logprobs.cpu(), want.logprobs, rtol=0, atol=1e-6)
    torch.testing.assert_close(got.raw_logprobs.cpu(), want.raw_logprobs, rtol=0, atol=1e-6)


# (torchax runs generate op by op, each new shape traced anew: 14 s a call, 70 s in all)
@pytest.mark.slow
def test_generate_continues_a_prompt_alike_alone_in_a_batch_and_left_padded():
    """docs/sampling.md, transformers: SeededSampling in generate(do_sample=True) on the jax device,
    on GPT-2's eager attention: on sdpa, a left-padded row's logits are NaN here (torchax's SDPA
    gives NaN for a query with no key to attend, where torch's gives 0; the padding positions' NaN
    then reach the last token through later layers: test_sdpa_of_left_padding_is_nan_on_torchax)."""
    check_continuations_alike_alone_in_a_batch_and_left_padded(torch.device("jax"), attention="eager")


def test_sdpa_of_left_padding_is_nan_on_torchax():
    """Why the generate test runs eager attention on torchax: a query that may attend to no key
    gets NaN from torchax's SDPA (torch's CPU SDPA gives 0). When this test fails, torchax has
    changed and the generate test can run sdpa."""
    query = torch.randn(1, 1, 4, 8, device="jax")
    mask = torch.tensor([[False] * 4, [True] * 4, [True] * 4, [True] * 4], device="jax")
    got = torch.nn.functional.scaled_dot_product_attention(query, query, query, attn_mask=mask).cpu()
    assert torch.isnan(got[0, 0, 0]).all() and torch.isfinite(got[0, 0, 1:]).all()
