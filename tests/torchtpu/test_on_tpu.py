"""The TorchTPU tier that needs a TPU (marked ``tpu``: skipped elsewhere, and not yet run on one):
real ``tpu`` tensors, kernels compiled by libtpu through TorchTPU's runtime, the hardware PRNG.
Run on a TPU VM with ``TORCH_PALLAS_STACK=torchtpu PJRT_DEVICE=TPU ./dev test tests/torchtpu``."""

import math

import jax
import numpy as np
import pytest
import torch

import torch_pallas
from reference import SEEDS, jax_key

pytestmark = pytest.mark.tpu

SHAPE = (256, 1024)


@pytest.mark.parametrize("seed", SEEDS[1:3])
def test_dropout_and_uniform_are_jax_randoms_bits_for_a_seed(seed):
    """The noise contract on TorchTPU: the bits an XLA, torchax or CPU tensor gets (JAX computes
    the reference on its CPU backend, where the front end keeps it)."""
    y = torch_pallas.dropout(torch.ones(SHAPE, device="tpu"), 0.25, seed=seed).cpu()
    expected = np.asarray(jax.random.bernoulli(jax_key(seed), 0.75, SHAPE))
    assert np.array_equal(y.numpy() != 0, expected)
    assert torch.equal(y[y != 0], torch.full_like(y[y != 0], 1 / 0.75))
    uniform = torch_pallas.random.uniform(SHAPE, seed=seed, device="tpu").cpu().numpy()
    assert np.array_equal(uniform.view(np.uint32), np.asarray(jax.random.uniform(jax_key(seed), SHAPE)).view(np.uint32))


@pytest.mark.parametrize("impl", ["threefry", "hardware"])
def test_the_backward_mask_is_the_forward_mask(impl):
    p, n = 0.3, math.prod(SHAPE)
    x = torch.rand(SHAPE, device="tpu").add_(1).requires_grad_()
    y = torch_pallas.dropout(x, p, impl=impl)
    y.sum().backward()
    kept = y.detach().cpu() != 0
    assert torch.equal(kept, x.grad.cpu() != 0), "the backward regenerated another mask"
    assert abs(kept.double().mean().item() - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n)


def test_manual_seed_repeats_a_run():
    x = torch.ones(SHAPE, device="tpu")
    runs = []
    for _ in range(2):
        torch.manual_seed(5)
        runs.append([torch_pallas.dropout(x, 0.5).cpu() for _ in range(2)])
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    assert not torch.equal(runs[0][0], runs[0][1]), "the same mask twice"


def test_a_compiled_gpt2_step_learns_without_recompiling():
    """TorchTPU's own compile backend (no ``backend=``) over the forward and loss; torch's
    autograd and AdamW outside it."""
    transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")
    torch.manual_seed(0)
    name = torch_pallas.register_attention()
    config = transformers.GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=2, attn_pdrop=0.1,
                                     resid_pdrop=0.1, embd_pdrop=0.1, use_cache=False, bos_token_id=0, eos_token_id=0)
    with torch.device("tpu"):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=name).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(3, 128, (4, 64)).to("tpu")

    @torch.compile(fullgraph=True)
    def loss_of(ids):
        with torch_pallas.route_dropout():
            logits = model(input_ids=ids).logits
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    losses, graphs = [], []
    for _ in range(8):
        loss = loss_of(ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs[-1] == graphs[1], f"recompiled after warm-up: {graphs}"
    assert losses[-1] < losses[0] - 0.5, losses
