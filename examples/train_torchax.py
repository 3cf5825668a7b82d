"""A small Hugging Face GPT-2 trained on torchax (torch tensors holding jax.Arrays) under one
``jax.jit``-compiled step, with every dropout from torch_pallas.

The model is built from a small config (no weights to download) with transformers' default
``sdpa`` attention and dropout 0.1 on the embeddings, the residuals and the attention
weights. Inside ``torch_pallas.route_dropout()`` every ``nn.Dropout`` runs as
``torch_pallas.dropout`` and ``F.scaled_dot_product_attention(dropout_p=0.1)`` as
``torch_pallas.scaled_dot_product_attention`` (flash kernels; the mask regenerated in the
backward pass from an 8-byte key).

The step is built as torchax's own helpers build one (``torchax.train.make_train_step``): the
model's forward as a function of its parameters (``interop.JittableModule``), JAX's
``value_and_grad`` over it (each torch_pallas op is a ``jax.custom_vjp`` whose backward is the
op's own backward kernels), Adam in plain JAX, the whole step under ``jax.jit``. The step takes
fresh key data every call (``torch_pallas.seeds.key_data()``, drawn eagerly from torchax's RNG)
and draws every mask inside from it (``torch_pallas.seeds.key_scope``): new keys are data, so
the step is traced once. The model learns to continue counting sequences (each token the
previous one plus one, modulo the vocabulary).

    .venv/torchax/bin/python examples/train_torchax.py      # needs transformers (the test extra)
"""

import contextlib
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # off TPU: JAX would otherwise try libtpu first

import jax  # noqa: E402
import torch  # noqa: E402
import torchax  # noqa: E402
import transformers  # noqa: E402
from torchax import interop  # noqa: E402

import torch_pallas  # noqa: E402

VOCABULARY, SEQUENCE, BATCH = 64, 32, 8


def make_model(layers: int = 2, width: int = 64) -> transformers.GPT2LMHeadModel:
    config = transformers.GPT2Config(
        vocab_size=VOCABULARY, n_positions=SEQUENCE, n_embd=width, n_layer=layers, n_head=4, attn_pdrop=0.1,
        resid_pdrop=0.1, embd_pdrop=0.1, use_cache=False, attn_implementation="sdpa", bos_token_id=0,
        eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def batches(generator: torch.Generator, batch: int = BATCH, sequence: int = SEQUENCE):
    while True:
        start = torch.randint(0, VOCABULARY, (batch, 1), generator=generator)
        yield (start + torch.arange(sequence)) % VOCABULARY  # the model shifts labels itself


def adam(learning_rate: float, betas=(0.9, 0.999), eps: float = 1e-8):
    """Adam in plain JAX (optax's, which torchax's helpers take, is not a dependency here):
    ``(init(params) -> state, update(params, grads, state) -> (params, state))``."""

    def init(params):
        return (jax.tree.map(jax.numpy.zeros_like, params), jax.tree.map(jax.numpy.zeros_like, params),
                jax.numpy.zeros((), jax.numpy.int32))

    def update(params, grads, state):
        first, second, count = state
        count = count + 1
        first = jax.tree.map(lambda m, g: betas[0] * m + (1 - betas[0]) * g, first, grads)
        second = jax.tree.map(lambda v, g: betas[1] * v + (1 - betas[1]) * g * g, second, grads)
        scale = learning_rate * jax.numpy.sqrt(1 - betas[1] ** count) / (1 - betas[0] ** count)
        params = jax.tree.map(lambda p, m, v: p - scale * m / (jax.numpy.sqrt(v) + eps), params, first, second)
        return params, (first, second, count)

    return init, update


def make_train_step(model: torch.nn.Module, update, route: bool = True):
    """``step(params, buffers, optimizer_state, ids, key_data) -> (loss, params,
    optimizer_state)``, a JAX function of arrays (jit it), and the model's parameters and
    buffers as arrays. ``route=False``: torch's (torchax's) dropouts and attention, to compare."""

    env = torchax.default_env()
    jittable = interop.JittableModule(model)

    def loss_of(params, buffers, ids, key_data):  # torchax tensors
        routing = torch_pallas.route_dropout() if route else contextlib.nullcontext()
        with env, routing, torch_pallas.seeds.key_scope(key_data):
            return jittable.functional_call("forward", params, buffers, input_ids=ids, labels=ids).loss

    value_and_grad = interop.jax_value_and_grad(loss_of)

    def step(params, buffers, state, ids, key_data):  # jax arrays
        loss, grads = interop.jax_view(value_and_grad(params, buffers, ids, key_data))  # it hands back torch views
        params, state = update(params, grads, state)
        return loss, params, state

    return step, interop.jax_view(jittable.params), interop.jax_view(jittable.buffers)


def train(steps: int = 8, seed: int = 0, layers: int = 2, width: int = 64, batch: int = BATCH,
          sequence: int = SEQUENCE, learning_rate: float = 3e-3):
    """Returns the loss of every step and the compiled step (``_cache_size()``: its traces)."""
    env = torchax.default_env()
    torch.manual_seed(seed)
    env.manual_seed(seed)
    model = make_model(layers, width).train()
    with env:
        model.to("jax")
    init, update = adam(learning_rate)
    step, params, buffers = make_train_step(model, update)
    state = init(params)
    compiled = jax.jit(step, donate_argnums=(0, 2))
    data = batches(torch.Generator().manual_seed(seed), batch, sequence)
    losses = []
    for _ in range(steps):
        with env:
            ids = next(data).to("jax")
            key_data = torch_pallas.seeds.key_data()  # fresh, from torchax's RNG, outside the trace
        loss, params, state = compiled(params, buffers, state, interop.jax_view(ids), interop.jax_view(key_data))
        losses.append(float(loss))
    return losses, compiled


def main():
    losses, compiled = train()
    print("losses:", " ".join(f"{loss:.3f}" for loss in losses))
    print(f"step traced {compiled._cache_size()} time(s)")


if __name__ == "__main__":
    main()
