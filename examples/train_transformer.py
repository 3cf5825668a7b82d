"""A small Hugging Face OPT model trained with every dropout from torch_pallas and its
decoder layers checkpointed, under ``torch.compile(backend="openxla")``.

OPT writes its dropouts as ``F.dropout`` calls (no ``nn.Dropout`` module), which
``torch_pallas.route_dropout()`` reaches; its attention runs the eager ("math") path so
that the attention dropout is one of them. ``torch_pallas.checkpoint.enable(model)`` turns
on gradient checkpointing with ``torch_pallas.checkpoint`` as the model's checkpoint
function (transformers' ``model.gradient_checkpointing_enable()`` fails on XLA), so each
layer's recomputation in the backward pass draws the forward's masks. The model is built from a small config (no
weights to download) and learns to continue counting sequences (each token the previous
one plus one, modulo the vocabulary).

    .venv/bin/python examples/train_transformer.py      # needs the test extra (transformers)
"""

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.debug.metrics as metrics  # noqa: E402
import transformers  # noqa: E402

import torch_pallas  # noqa: E402

VOCABULARY, SEQUENCE, BATCH = 64, 32, 8


def make_model() -> transformers.OPTForCausalLM:
    config = transformers.OPTConfig(
        vocab_size=VOCABULARY, hidden_size=64, num_hidden_layers=2, ffn_dim=128, num_attention_heads=4,
        max_position_embeddings=SEQUENCE + 2, word_embed_proj_dim=64, dropout=0.1, attention_dropout=0.1,
        activation_dropout=0.1, attn_implementation="eager")
    model = transformers.OPTForCausalLM(config)
    return torch_pallas.checkpoint.enable(model)  # model.gradient_checkpointing_enable(), for XLA


def batches(generator: torch.Generator):
    while True:
        start = torch.randint(0, VOCABULARY, (BATCH, 1), generator=generator)
        yield (start + torch.arange(SEQUENCE)) % VOCABULARY  # the model shifts labels itself


def train(steps: int = 30, seed: int = 0) -> tuple[list[float], list[int]]:
    """Returns the loss of every step and the XLA compile count after each."""
    device = torch_xla.device()
    torch.manual_seed(seed)
    model = make_model().to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    forward = torch.compile(lambda ids, labels: model(input_ids=ids, labels=labels).loss, backend="openxla")
    torch_xla.manual_seed(seed)
    losses, compiles = [], []
    data = batches(torch.Generator().manual_seed(seed))
    for _ in range(steps):
        ids = next(data).to(device)
        optimizer.zero_grad()
        with torch_pallas.route_dropout():
            loss = forward(ids, ids)
        loss.backward()
        optimizer.step()
        torch_xla.sync()
        losses.append(loss.item())
        compiles.append(metrics.metric_data("CompileTime")[0])
    return losses, compiles


def main():
    losses, compiles = train()
    print(f"loss: first {losses[0]:.3f}, last {losses[-1]:.3f}")
    print(f"XLA graphs compiled: {compiles[-1]} ({compiles[-1] - compiles[2]} after the first 3 steps)")


if __name__ == "__main__":
    main()
