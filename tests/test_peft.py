"""PEFT's LoRA as a client, on the lazy XLA device: under route_dropout() every
``lora_A(lora_dropout(x))`` runs as one dropout_linear kernel with the unfused call's masks (a
Llama-style model with GQA, and GPT-2, whose Conv1D base layers PEFT adapts with
``fan_in_fan_out``), routed or converted; a converted LoRA model trains and the same XLA seed
repeats the run."""

import pytest
import torch
import torch_xla

peft = pytest.importorskip("peft", reason="peft is in the test extra (pyproject.toml); install it to run these")
transformers = pytest.importorskip("transformers")

import torch_pallas  # noqa: E402
from conftest import read_together  # noqa: E402
from kernel_calls import kernel_calls  # noqa: E402

DEVICE = torch_xla.device()
LAYERS = 2


def lora_llama(dtype=torch.float32):
    """Llama-style (GQA: 4 query heads, 2 key-value heads), LoRA on every projection, QLoRA's
    dropout; in bfloat16 PEFT's adapters are float32 and it casts their inputs."""
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=LAYERS,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    return peft.get_peft_model(transformers.LlamaForCausalLM(config).to(dtype), lora), 7


def lora_gpt2():
    """GPT-2 (embedding, attention and residual dropouts of its own), LoRA on its Conv1D layers."""
    config = transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=128, n_layer=LAYERS, n_head=4)
    lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, target_modules=["c_attn", "c_proj", "c_fc"],
                           fan_in_fan_out=True)
    return peft.get_peft_model(transformers.GPT2LMHeadModel(config), lora), 4  # c_proj: attention's and the MLP's


MODELS = {"llama": lora_llama, "gpt2": lora_gpt2, "llama-bfloat16": lambda: lora_llama(torch.bfloat16)}


def ids():
    return torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0)).to(DEVICE)


def step(model, fuse: bool):
    """One forward and backward from XLA seed 0: the loss, the LoRA weights' gradients, and the
    torch_pallas kernels of the forward graph (3 for dropout_linear's, 2 for dropout's, 0 for the
    others) with the dtype of each one's second operand (what it drops: ``bf16``, ``f32``), under
    ``route_dropout()`` or, without ``fuse``, with ``fuse_linear=False``."""
    model.zero_grad(set_to_none=True)
    torch_xla.manual_seed(0)
    with torch_pallas.route_dropout(**({} if fuse else dict(fuse_linear=False))):
        batch = ids()
        loss = model(input_ids=batch, labels=batch).loss
    shapes, calls = kernel_calls(loss)
    loss.backward()
    grads = [p.grad for name, p in model.named_parameters() if p.requires_grad]
    # dropout_linear's third operand is its 2-D weight (dropout_add's its residual, of x's shape)
    dims = [shapes.get(operands[-1], "[]").split("[")[1].split("]")[0] for _, operands in calls]
    linear = [len(operands) == 3 and dims.count(",") == 1 for dims, (_, operands) in zip(dims, calls)]
    return [loss, *grads], [(3 if is_linear else 2 if len(operands) == 2 else 0, shapes.get(operands[1], "?").split("[")[0])
                            for is_linear, (_, operands) in zip(linear, calls)]


@pytest.mark.parametrize("converted", [False, True], ids=["routed", "converted"])
# (Llama in float32, 25 s, in the slow tier: the bfloat16 run is the same model, with PEFT's float32 adapters)
@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow if name == "llama" else ())
                                  for name in MODELS])
def test_lora_dropout_runs_in_lora_as_kernel_with_the_unfused_masks(name, converted):
    torch.manual_seed(0)
    model, adapted_per_layer = MODELS[name]()
    model = (torch_pallas.convert_dropout(model) if converted else model).to(DEVICE).train()
    unfused, unfused_kernels = step(model, fuse=False)
    fused, fused_kernels = step(model, fuse=True)
    lora_linears = adapted_per_layer * LAYERS
    fused_linears = [dtype for operands, dtype in fused_kernels if operands == 3]
    assert len(fused_linears) == lora_linears and not [1 for operands, _ in unfused_kernels if operands == 3]
    # bfloat16: each kernel reads the model's bfloat16 activations, not PEFT's float32 cast of them.
    assert set(fused_linears) == {"bf16" if name == "llama-bfloat16" else "f32"}
    # The fused forward draws no dropout of its own for the LoRA inputs: only the model's own dropouts remain.
    assert ([operands for operands, _ in fused_kernels].count(2)
            == [operands for operands, _ in unfused_kernels].count(2) - lora_linears)
    unfused, fused = read_together(unfused, fused)
    # bfloat16: the float32 LoRA sums, in another order, can round the bfloat16 layer outputs apart.
    loss_tolerance, grad_tolerance = ((1e-5, 1e-5), (1e-4, 1e-5)) if name != "llama-bfloat16" else ((1e-2, 1e-2),) * 2
    torch.testing.assert_close(fused[0], unfused[0], rtol=loss_tolerance[0], atol=loss_tolerance[1])
    for got, want in zip(fused[1:], unfused[1:]):
        torch.testing.assert_close(got, want, rtol=grad_tolerance[0], atol=grad_tolerance[1])


def test_a_converted_lora_model_trains_and_the_same_seed_repeats_the_run():
    def train():
        torch.manual_seed(0)
        model, _ = lora_llama()
        model = torch_pallas.convert_dropout(model).to(DEVICE).train()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        losses = []
        for seed in range(4):
            torch_xla.manual_seed(seed)
            with torch_pallas.route_dropout():
                batch = ids()
                loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            torch_xla.sync()
            losses.append(loss.item())
        return losses

    first = train()
    assert first[-1] < first[0]
    assert train() == first


def test_checkpointed_lora_layers_recompute_their_forward_masks():
    """torch_pallas.checkpoint.enable on a PeftModel (frozen embeddings: it turns on input grads,
    or no adapter would get a gradient through the reentrant regions): the gradients are those of
    the same layers run without recomputation under the keys the checkpoint draws, so each
    recomputed fused kernel drew its forward's masks."""
    def grads(checkpoint_function):
        torch.manual_seed(0)
        config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                                          num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2)
        lora = peft.LoraConfig(r=8, lora_dropout=0.5, target_modules=["q_proj", "v_proj", "down_proj"],
                               init_lora_weights=False)  # lora_B not zero: lora_A's gradients show the masks
        model = peft.get_peft_model(transformers.LlamaForCausalLM(config), lora).to(DEVICE).train()
        checkpoint_function(model)
        torch_xla.manual_seed(0)
        with torch_pallas.route_dropout():
            batch = ids()
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        return [p.grad for p in model.parameters() if p.requires_grad]

    def same_keys_kept(model):
        def layer_in_its_key_scope(function, *args):
            with torch_pallas.seeds.key_scope(torch_pallas.seeds.key_data()):  # what checkpoint draws
                return function(*args)
        model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=layer_in_its_key_scope)

    recomputed, kept = read_together(grads(torch_pallas.checkpoint.enable), grads(same_keys_kept))
    assert len(recomputed) == 3 * 2 * LAYERS and all(grad.abs().sum() > 0 for grad in recomputed)
    for got, want in zip(recomputed, kept):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_trainer_trains_a_converted_lora_model_on_the_xla_device(tmp_path, monkeypatch):
    """docs/lora.md: transformers' Trainer on the XLA device, with optim="adamw_torch" (its default,
    fused AdamW, refuses XLA tensors); every LoRA input's dropout runs fused, and the XLA seed set
    before train() decides the masks and repeats the run (the Trainer's seed does not: transformers'
    set_seed leaves the XLA RNG, which torch's dropout draws from too, as it was)."""
    fused_calls = []
    original = torch_pallas.ops.dropout_linear.apply
    monkeypatch.setattr(torch_pallas.ops.dropout_linear, "apply",
                        lambda *args, **kwargs: fused_calls.append(1) or original(*args, **kwargs))

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, index):
            tokens = torch.randint(0, 256, (32,), generator=torch.Generator().manual_seed(index))
            return {"input_ids": tokens, "labels": tokens}

    def train(xla_seed):
        torch.manual_seed(0)
        model = torch_pallas.convert_dropout(lora_llama()[0])
        args = transformers.TrainingArguments(tmp_path, optim="adamw_torch", max_steps=3, per_device_train_batch_size=2,
                                              learning_rate=1e-2, seed=0, logging_steps=1, report_to=[],
                                              save_strategy="no")
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens())
        torch_xla.manual_seed(xla_seed)
        with torch_pallas.route_dropout():
            trainer.train()
        assert model.device.type == "xla"
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    first = train(xla_seed=0)
    assert len(first) == 3 and len(fused_calls) == 3 * 7 * LAYERS
    assert train(xla_seed=0) == first
    # The same batches and initial weights: only the masks differ (lora_B starts at zero, so the
    # first step's loss has none to show).
    assert train(xla_seed=1)[1:] != first[1:]
