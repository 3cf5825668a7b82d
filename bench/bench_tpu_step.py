"""Whole training steps of transformers models compiled for TPU by libtpu, on a machine without a TPU.

    ./dev bench --only tpu_step --full   # every model, attention, variant and generation (hours on 2 cores)
    ./dev bench --only tpu_step          # GPT-2 for v5e (tens of minutes on 2 cores)
    .venv/xla/bin/python bench/bench_tpu_step.py --models bert --generations v4   # any subset
    .venv/xla/bin/python bench/bench_tpu_step.py --models gpt2-128 --attentions sdpa \
        --variants "torch_pallas tiled" torch --generations v5e
    .venv/torchax/bin/python bench/bench_tpu_step.py --generations tpu7x          # the torchax stack
Every run keeps the committed rows it did not redo (results/tpu_step.json).

One step (forward, loss, backward; outputs: the loss and every gradient) of GPT-2, BERT (masked
LM), ViT (image classification) and T5 (sequence to sequence) at the sizes users train (GPT-2
small, BERT-base, ViT-B/16, T5-base widths, with fewer layers than the released models where
``LAYERS`` says so: compile time on this machine grows with layers, the per-layer figures do not
change), and GPT-2 and BERT again at 8 x 128 tokens (``gpt2-128``, ``bert-128``: short sequences,
where fixed per-call costs weigh most), every dropout p=0.1, built in these variants with the same weights:

- ``torch_pallas default``: ``route_dropout()``, what a user gets without options (the README's
  line): every dropout routed to torch_pallas with the default noise impl (``tiled``), residual
  adds, eager attention's products and linear layers of at most 128 output features after a
  dropout fused; each kernel a Mosaic TPU custom call in the graph (built under
  ``tpu_compile.lowering_for_tpu()``);
- ``torch_pallas threefry`` / ``torch_pallas hardware`` / ``torch_pallas tiled``: the same with
  that noise impl (``route_dropout(impl=..., fuse_residual=True, fuse_matmul=True)``, what the
  defaults have been since 2026-12-01: ``tiled`` is ``default``);
- ``torch_pallas tiled linear``: every linear layer after a dropout fused, nothing else
  (``route_dropout(fuse_linear=True)``);
- ``torch_pallas threefry unfused`` / ``torch_pallas tiled unfused``: nothing fused
  (``route_dropout(impl=..., fuse_linear=False)``);
- ``torch``: torch's own dropout (XLA draws each mask and keeps it for the backward pass);
- ``no dropout``: the model in eval mode (every dropout the identity), the floor.

and with the model's attention implementations (transformers' ``sdpa``, its default; ``eager``).
Each graph is compiled for one chip of each generation by libtpu's compile-only client
(``tpu_compile.compile_graph``). On the torchax stack, whose libtpu also knows TPU7x, the step is
a JAX function of the parameters (:func:`step_function`) compiled by ``tpu_compile.analyze_for_tpu``,
and ``torch`` is torchax's dropout (``jax.random`` bits drawn by XLA); its rows are kept apart.
Reported: the compiler's peak HBM bytes, its cost analysis's bytes accessed, and the estimated
step time (``tpu_schedule.estimate`` of the compile's dumps, as ``compile_graph(...,
estimate=True)`` gives it, with its time per kind of op and every kernel's schedule and HBM time: what
a ratio above 1.0x comes from; a program the estimate cannot count, or TPU7x's, is reported without
one, from the same compile). Nothing runs on a TPU: these are what the compiler plans, not
measurements.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import hashlib
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS, commit, markdown_table, mask_noise_floor_seconds, merged_rows, write  # noqa: E402

P = 0.1
# "torch_pallas default": route_dropout() as a user gets it without options; "torch_pallas <impl>": every dropout
# routed with that noise impl, residual adds, eager attention's products and linear layers of at most 128 features
# after a dropout fused (the defaults); "torch_pallas tiled linear": every linear layer after a dropout fused,
# nothing else; "torch_pallas <impl> unfused": nothing fused.
VARIANTS = ("torch_pallas default", "torch_pallas threefry", "torch_pallas hardware", "torch_pallas tiled",
            "torch_pallas tiled linear", "torch_pallas threefry unfused", "torch_pallas tiled unfused", "torch",
            "no dropout")
ROUTED_VARIANTS = tuple(variant for variant in VARIANTS if variant.startswith("torch_pallas"))
# transformers' own (``sdpa``, its default; ``eager``) and torch_pallas's flash kernels registered with its
# AttentionInterface (``torch_pallas.register_attention()``), measured against ``eager`` with torch's dropout.
ATTENTIONS = ("sdpa", "eager", "torch_pallas")
REFERENCE_ATTENTION = {"sdpa": "sdpa", "eager": "eager", "torch_pallas": "eager"}
# Released sizes: GPT-2 small 12 layers, BERT-base 12, ViT-B/16 12, T5-base 12 + 12.
LAYERS = 2
# Rows measured before this commit (they carry no "commit") ran kernels that read key and value as
# (S, E) planes wherever; the table marks their torch_pallas figures until they are measured again.
KEY_VALUE_TRANSPOSED = "10ca643"
# Estimates made before this commit (their records name no "estimator") counted a loop once where its
# closing branch's bundle number passed the branch's own index, after long bundles (an XLA copy loop,
# the RNG, a kernel on operands XLA keeps in VMEM): a graph is compiled again rather than take such a
# record's figures. No committed estimate is older.
ESTIMATOR = "b84cc66"
PATH = RESULTS / "tpu_step.json"
# The defaults' rule (issues 62, 71): route_dropout()'s steps at or below torch's in peak HBM and time on these
# generations, judged with the newest libtpu a stack runs; tpu_step_newer_libtpu compiles the torch_xla
# stack's HLOs by the torchax stack's newer libtpu too.
RULE_VARIANT = "torch_pallas default"
RULE_GENERATIONS = ("v5e", "v5p", "v6e")
NEWER_LIBTPU_PATH = RESULTS / "tpu_step_newer_libtpu.json"


def _gpt2(transformers, torch, attention, layers, tokens=1024):
    config = transformers.GPT2Config(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=layers, n_head=12,
                                     attn_pdrop=P, resid_pdrop=P, embd_pdrop=P, use_cache=False,
                                     attn_implementation=attention)
    ids = torch.randint(0, config.vocab_size, (8, tokens))
    return transformers.GPT2LMHeadModel(config), dict(input_ids=ids, labels=ids)


def _bert(transformers, torch, attention, layers, tokens=512):
    config = transformers.BertConfig(num_hidden_layers=layers, hidden_dropout_prob=P, attention_probs_dropout_prob=P,
                                     attn_implementation=attention)
    ids = torch.randint(0, config.vocab_size, (8, tokens))
    return transformers.BertForMaskedLM(config), dict(input_ids=ids, labels=ids)


def _vit(transformers, torch, attention, layers):
    config = transformers.ViTConfig(num_hidden_layers=layers, hidden_dropout_prob=P, attention_probs_dropout_prob=P,
                                    num_labels=1000, attn_implementation=attention)
    pixels = torch.randn(32, 3, 224, 224)
    labels = torch.randint(0, 1000, (32,))
    return transformers.ViTForImageClassification(config), dict(pixel_values=pixels, labels=labels)


def _t5(transformers, torch, attention, layers):
    config = transformers.T5Config(d_model=768, d_kv=64, d_ff=3072, num_heads=12, num_layers=layers,
                                   num_decoder_layers=layers, dropout_rate=P, decoder_start_token_id=0, pad_token_id=0,
                                   attn_implementation=attention)
    ids = torch.randint(0, config.vocab_size, (8, 512))
    labels = torch.randint(0, config.vocab_size, (8, 128))
    return transformers.T5ForConditionalGeneration(config), dict(input_ids=ids, labels=labels)


_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


LLAMA_WIDTH, LLAMA_MLP, LLAMA_BATCH = 1024, 2816, 4


def _llama_lora(transformers, torch, attention, layers, tokens=1024, kv_heads=16):
    """A Llama-style model in bfloat16 fine-tuned with PEFT's LoRA as QLoRA-style recipes do (rank
    16 on every projection, lora_dropout p; the adapters in float32, PEFT's default): its only
    dropouts are LoRA's, ``lora_A(dropout(x))`` on each adapted layer."""
    import peft

    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=LLAMA_WIDTH, intermediate_size=LLAMA_MLP,
                                      num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=kv_heads,
                                      max_position_embeddings=tokens, attn_implementation=attention)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=P,
                                                       target_modules=_LORA_TARGETS))
    ids = torch.randint(0, config.vocab_size, (LLAMA_BATCH, tokens))
    return model, dict(input_ids=ids, labels=ids)


def llama_lora_mask_elements(model_name: str, layers: int) -> int | None:
    """Elements of every dropout mask in one step of a Llama-style LoRA model (``None`` for the
    other models): each adapted projection's input, its tokens by its in_features (q, k, v, o,
    gate and up read the width, down the MLP's)."""
    if not model_name.startswith("llama"):
        return None
    tokens = LLAMA_BATCH * getattr(MODELS[model_name][1], "keywords", {}).get("tokens", 1024)
    return layers * tokens * (6 * LLAMA_WIDTH + LLAMA_MLP)


def _gpt2_lora(transformers, torch, attention, layers, tokens=1024):
    """GPT-2 small with PEFT's LoRA (rank 16 on its ``Conv1D`` attention and MLP projections,
    ``fan_in_fan_out``, lora_dropout p; the adapters in float32) over its own dropouts."""
    import peft

    model, batch = _gpt2(transformers, torch, attention, layers, tokens)
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=P, fan_in_fan_out=True,
                                                       target_modules=["c_attn", "c_proj", "c_fc"]))
    return model, batch


MODELS = {"gpt2": ("GPT-2 small: width 768, 12 heads, vocabulary 50257, 8 x 1024 tokens, language-model loss", _gpt2),
          "gpt2-128": ("GPT-2 small at 8 x 128 tokens", functools.partial(_gpt2, tokens=128)),
          "bert": ("BERT-base: width 768, 12 heads, 8 x 512 tokens, masked-LM loss on every token", _bert),
          "bert-128": ("BERT-base at 8 x 128 tokens", functools.partial(_bert, tokens=128)),
          "vit": ("ViT-B/16: width 768, 12 heads, 32 images of 224 x 224, 1000 classes", _vit),
          "t5": ("T5-base widths: d_model 768, 12 heads, d_ff 3072, 8 x 512 input and 8 x 128 target tokens", _t5),
          "llama-lora": ("Llama-style, bfloat16: width 1024, 16 heads, MLP 2816, vocabulary 32000, 4 x 1024 "
                         "tokens, PEFT LoRA r=16 on q, k, v, o, gate, up, down", _llama_lora),
          "llama-gqa-lora": ("llama-lora with 4 key-value heads (GQA)", functools.partial(_llama_lora, kv_heads=4)),
          "llama-lora-512": ("llama-lora at 4 x 512 tokens", functools.partial(_llama_lora, tokens=512)),
          "llama-lora-2048": ("llama-lora at 4 x 2048 tokens", functools.partial(_llama_lora, tokens=2048)),
          "llama-gqa-lora-512": ("llama-gqa-lora at 4 x 512 tokens",
                                 functools.partial(_llama_lora, tokens=512, kv_heads=4)),
          "llama-gqa-lora-2048": ("llama-gqa-lora at 4 x 2048 tokens",
                                  functools.partial(_llama_lora, tokens=2048, kv_heads=4)),
          "gpt2-lora": ("GPT-2 small at 8 x 1024 tokens with PEFT LoRA r=16 on c_attn, c_proj, c_fc "
                        "(fan_in_fan_out) over its own dropouts", _gpt2_lora),
          "gpt2-lora-512": ("gpt2-lora at 8 x 512 tokens (GPT-2 has no 2048: its positions end at 1024)",
                            functools.partial(_gpt2_lora, tokens=512))}


def stack() -> str:
    """The stack this process runs: ``"xla"`` (torch_xla's lazy graph, libtpu 0.0.21: v4 to v6e)
    or ``"torchax"`` (the step as a JAX function, its libtpu also knows TPU7x)."""
    from torch_pallas import bridge

    return bridge.STACK


def build(model_name: str, attention: str, layers: int):
    """The model and its batch on the stack's device (torch_xla's, or torchax's ``jax``), or None
    when transformers cannot build the model with that attention (T5 has no ``sdpa`` in
    transformers 4.57)."""
    import torch
    import transformers

    import torch_pallas

    if attention == "torch_pallas":
        torch_pallas.register_attention()
    torch.manual_seed(0)
    unavailable = f"transformers {transformers.__version__} has no {attention} attention for this model"
    try:
        model, batch = MODELS[model_name][1](transformers, torch, attention, layers)
    except (ValueError, KeyError):
        # ValueError: transformers refuses an implementation the model lacks (T5 4.57: sdpa);
        # KeyError: a model that does not look attention up in AttentionInterface (BERT 4.57).
        return None, unavailable
    if attention == "torch_pallas" and not getattr(model, "_supports_attention_backend", False):
        return None, unavailable  # T5 4.57 takes the name and runs its own eager attention anyway
    if stack() == "torchax":
        import torchax

        with torchax.default_env():
            return model.to("jax"), {name: value.to("jax") for name, value in batch.items()}
    import torch_xla

    device = torch_xla.device()
    model, batch = model.to(device), {name: value.to(device) for name, value in batch.items()}
    # Device data, not pending random ops: the step's inputs, as in training.
    torch_xla.sync()
    return model, batch


def routing(variant: str):
    """A routed variant's noise impl and its ``route_dropout`` (``(None, None)`` for ``torch`` and
    ``no dropout``)."""
    import torch_pallas

    if variant not in ROUTED_VARIANTS:
        return None, None
    if variant == "torch_pallas default":
        return None, torch_pallas.route_dropout()
    impl = variant.split()[1]
    if variant.endswith(" linear"):
        return impl, torch_pallas.route_dropout(impl=impl, fuse_linear=True)
    if variant.endswith(" unfused"):
        return impl, torch_pallas.route_dropout(impl=impl, fuse_linear=False, fuse_residual=False, fuse_matmul=False)
    return impl, torch_pallas.route_dropout(impl=impl, fuse_residual=True, fuse_matmul=True)


def label(variant: str) -> str:
    """A variant's name in the tables: a routed one's without ``torch_pallas``."""
    return variant.removeprefix("torch_pallas ")


def step_outputs(model, batch, variant: str) -> list:
    """The loss and every gradient of one step, as pending XLA tensors (never run here)."""
    import torch_pallas
    from torch_pallas import tpu_compile

    model.train(variant != "no dropout").zero_grad(set_to_none=True)
    with tpu_compile.lowering_for_tpu():  # inside: impl="hardware" is accepted only while lowering for TPU
        impl, route = routing(variant)
        with route or contextlib.nullcontext():
            # The default impl too: register_attention's function (attn_implementation="torch_pallas") takes it.
            torch_pallas.random.set_default_impl(impl)
            try:
                loss = model(**batch).loss
                loss.backward()
            finally:
                torch_pallas.random.set_default_impl(None)
    return [loss, *(parameter.grad for parameter in model.parameters() if parameter.grad is not None)]


def graph_digest(hlo: str) -> str:
    """The sha256 of a step's HLO without its metadata (names of the ops' Python sources): two
    steps with one digest are one program (ViT's ``sdpa`` and ``"torch_pallas"`` attention both
    run the flash kernels), which compiles to the same figures."""
    return hashlib.sha256(re.sub(r", metadata=\{[^}]*\}", "", hlo).encode()).hexdigest()


# Figures a record of the same graph gives another (not what names the row).
_NAMING = ("model", "attention", "layers", "stack", "variant", "generation", "same_graph_as")


def step_function(model, batch, variant: str):
    """torchax: one step as a JAX function of flat arrays (the parameters, buffers, batch and key
    data), ``step(*arrays) -> (loss, gradients)``, and those arrays' shapes. ``torch``: torchax's
    dropout, which draws from its environment's key (here the step's key data, as a JAX key)."""
    import jax
    import torchax
    from torchax import interop

    import torch_pallas
    from torch_pallas import tpu_compile

    env = torchax.default_env()
    model.train(variant != "no dropout")
    with tpu_compile.lowering_for_tpu():
        impl, route = routing(variant)
    jittable = interop.JittableModule(model)
    # torchax 0.0.13's JittableModule takes every tensor attribute dir() lists, PEFT's read-only `weight`
    # properties too (a LoRA layer's base weight by a second name), and then cannot set them: leave those out.
    for name in [name for name in jittable.buffers if _is_property(model, name)]:
        del jittable.buffers[name]

    def loss_of(params, buffers, batch, key_data):  # torchax tensors
        with contextlib.ExitStack() as scope:
            scope.enter_context(env)
            if route is not None:
                scope.enter_context(route)
                scope.enter_context(torch_pallas.seeds.key_scope(key_data))
            else:
                words = jax.lax.bitcast_convert_type(interop.jax_view(key_data), jax.numpy.uint32)
                scope.enter_context(env.override_property(prng=jax.random.wrap_key_data(words)))
            return jittable.functional_call("forward", params, buffers, **batch).loss

    value_and_grad = interop.jax_value_and_grad(loss_of)
    with env:
        key_data = torch_pallas.seeds.key_data(seed=0)
    arrays, tree = jax.tree.flatten(interop.jax_view((jittable.params, jittable.buffers, batch, key_data)))

    def step(*arrays):
        # The backward kernels are traced after loss_of returns: lowering for TPU spans the whole step.
        with tpu_compile.lowering_for_tpu():
            torch_pallas.random.set_default_impl(impl)
            try:
                return interop.jax_view(value_and_grad(*jax.tree.unflatten(tree, arrays)))
            finally:
                torch_pallas.random.set_default_impl(None)

    return step, [jax.ShapeDtypeStruct(array.shape, array.dtype) for array in arrays]


def _is_property(model, qualified_name: str) -> bool:
    """Whether ``qualified_name`` is a property of its module's class, not a tensor it holds."""
    path, _, attribute = qualified_name.rpartition(".")
    module = model.get_submodule(path) if path else model
    return isinstance(getattr(type(module), attribute, None), property)


def kernels_in(jaxpr) -> int:
    """The ``pallas_call``s in ``jaxpr`` and the jaxprs it calls (its text prints a function
    called several times once)."""
    import jax.extend

    return sum(1 if equation.primitive.name == "pallas_call" else
               sum(kernels_in(inner) for inner in jax.extend.core.jaxprs_in_params(equation.params))
               for equation in jaxpr.eqns)


def versions() -> dict:
    """The torchax stack's packages, which a torchax row records (the results' header names the xla stack's)."""
    from importlib import metadata

    return {name: metadata.version(name) for name in ("torch", "torchax", "jax", "libtpu", "transformers")}


def measure(model, batch, variant: str, generations, known=None):
    """Yields one record per generation as it is compiled; a graph in ``known`` (``{(digest,
    generation): record}``) takes that record's figures, with ``same_graph_as`` naming it,
    instead of compiling again."""
    import jax

    from torch_pallas import tpu_compile, tpu_schedule

    outputs = None
    if stack() == "torchax":
        from jax._src.interpreters import partial_eval

        step, shapes = step_function(model, batch, variant)
        jaxpr = jax.make_jaxpr(step)(*shapes)
        text, digest_name, extra = str(jaxpr), "jaxpr_sha256", {"versions": versions()}
        # Counted after dead-code elimination, as XLA keeps them: inside jax.jit a fused residual
        # dropout leaves the unfused dropout's kernel traced but dead (jax's private pass; bench only).
        kernels = kernels_in(partial_eval.dce_jaxpr(jaxpr.jaxpr, [True] * len(jaxpr.jaxpr.outvars))[0])

        def compile_for(generation):
            return tpu_compile.analyze_for_tpu(step, *shapes, generation=generation, estimate=False)
    else:
        import torch_xla

        outputs = step_outputs(model, batch, variant)
        text, digest_name, extra = torch_xla._XLAC._get_xla_tensors_hlo(outputs), "hlo_sha256", {}
        kernels = text.count('custom_call_target="tpu_custom_call"')

        def compile_for(generation):
            return tpu_compile.compile_graph(outputs, generation)
    digest = graph_digest(text)
    for generation in generations:
        same = (known or {}).get((digest, generation))
        if same is not None and same.get("estimator") == ESTIMATOR:
            yield {**{k: v for k, v in same.items() if k not in _NAMING}, "variant": variant,
                   "generation": generation, "same_graph_as": f"{same['model']} {same['attention']}"}
            continue
        with tpu_compile.compiler_dumps() as dumps:
            compiled = compile_for(generation)
        try:
            estimate, unestimated = tpu_schedule.estimate(dumps, generation), None
        except NotImplementedError as error:  # a program the estimate cannot count (a loop at top level; TPU7x)
            estimate, unestimated = None, str(error)
        print(variant, generation, f"{compiled.seconds:.0f} s", file=sys.stderr, flush=True)
        yield {
            "variant": variant, "generation": generation, "compile_s": compiled.seconds,
            "peak_bytes": compiled.peak_bytes, "temp_bytes": compiled.temp_bytes,
            "bytes_accessed": compiled.bytes_accessed, "flops": compiled.flops, "tpu_custom_calls": kernels,
            "estimate_s": estimate and estimate.seconds, "hbm_bytes": estimate and estimate.hbm_bytes,
            "unestimated": unestimated, digest_name: digest, "commit": commit(), "estimator": ESTIMATOR,
            **extra,
            "slowest_ops": estimate and [[op.name, op.kind, op.seconds]
                                         for op in sorted(estimate.ops, key=lambda op: -op.seconds)[:8]],
            **(estimate and breakdown(estimate) or {})}
    # The CPU client cannot run these graphs: drop them before anything syncs.
    del outputs, compile_for
    model.zero_grad(set_to_none=True)


def breakdown(estimate) -> dict:
    """Where an estimate's time goes: ``seconds_by_kind`` (the top-level program's own bundles, and
    per kind of op, ``tpu_schedule.OpEstimate.kind``: how many, their time, and the parts of it
    the schedule and HBM traffic bound) and ``kernel_ops`` (every Mosaic kernel: name, bundles,
    schedule and HBM seconds), so a kernel bound by its schedule rather than its bytes shows."""
    by_kind = {"program": {"ops": 1, "seconds": estimate.program_seconds}}
    for op in estimate.ops:
        kind = by_kind.setdefault(op.kind, {"ops": 0, "seconds": 0.0, "schedule_bound_s": 0.0, "hbm_bound_s": 0.0})
        kind["ops"] += 1
        kind["seconds"] += op.seconds
        kind["schedule_bound_s" if op.schedule_seconds > op.hbm_seconds else "hbm_bound_s"] += op.seconds
    kernels = [[op.name, op.bundles, op.schedule_seconds, op.hbm_seconds] for op in estimate.ops if op.kind == "kernel"]
    return {"seconds_by_kind": by_kind, "kernel_ops": kernels}


def _stack_of(record) -> str:
    return record.get("stack", "xla")  # rows measured before the torchax stack was benchmarked name none


def _key(record):
    return record["model"], record["attention"], record["variant"], record["generation"], _stack_of(record)


def _graph_key(record):
    return record.get("hlo_sha256") or record.get("jaxpr_sha256"), record["generation"]


def measure_all(models, attentions, variants, generations, layers) -> list:
    records = []
    known = {_graph_key(r): r for r in merged([]) if _graph_key(r)[0]}
    for model_name in models:
        for attention in attentions:
            model, batch = build(model_name, attention, layers)
            base = {"model": model_name, "attention": attention, "layers": layers, "stack": stack()}
            if model is None:
                records += [{**base, "variant": v, "generation": g, "unavailable": batch}
                            for v in variants for g in generations]
                save(records)
                continue
            for variant in variants:
                if attention == "torch_pallas" and variant not in ROUTED_VARIANTS:
                    continue  # its attention dropout is torch_pallas's whatever the variant
                for record in measure(model, batch, variant, generations, known):
                    records.append({**base, **record})
                    if "same_graph_as" not in record:
                        known[_graph_key(records[-1])] = records[-1]
                    save(records)  # a long run keeps what it measured if a later compile fails or is stopped
            del model, batch
    return records


def save(records: list) -> str:
    """Writes ``records`` over the committed results (results/tpu_step.{json,md}); returns the table.
    Runs side by side (other ``--models`` or ``--generations``) each keep the others' rows: the
    results are read and written under a lock."""
    PATH.parent.mkdir(parents=True, exist_ok=True)
    with open(PATH, "a") as lock:  # the file itself: write() rewrites it in place, the lock's inode
        fcntl.flock(lock, fcntl.LOCK_EX)
        records = merged(records)
        table = render(records)
        # The header names the xla stack, whose rows most are; torchax rows name their packages themselves.
        header = _committed().get("machine") if stack() == "torchax" else None
        write("tpu_step", {"mode": "compile only", "results": records}, table, None, header)
    return table


def _committed() -> dict:
    """results/tpu_step.json as it is now ({} before the first run; save's lock creates it empty)."""
    text = PATH.read_text() if PATH.exists() else ""
    return json.loads(text) if text.strip() else {}


def merged(records: list) -> list:
    """``records`` over the committed results: a partial run replaces only its own rows."""
    return merged_rows([r for r in _committed().get("results", []) if "model" in r], records, _key)


def render(records: list) -> str:
    """The markdown of ``records``: notes, then one row per model, attention and generation with
    each torch_pallas variant's ratio to torch's dropout."""
    by = {_key(r): r for r in records}
    rows = []
    for model_name in MODELS:
        for attention in ATTENTIONS:
            # The xla stack's generations, then those measured on torchax (its libtpu knows TPU7x).
            places = sorted({(_stack_of(r), r["generation"]) for r in records
                             if r["model"] == model_name and r["attention"] == attention},
                            key=lambda place: (place[0] != "xla", len(place[1]), place[1]))
            for stack_name, generation in places:
                def find(attention_name, variant):
                    return by.get((model_name, attention_name, variant, generation, stack_name))

                generation_label = place_label(generation, stack_name)
                torch_row = find(REFERENCE_ATTENTION[attention], "torch")
                own = next(filter(None, (find(attention, variant) for variant in ROUTED_VARIANTS)), {})
                if torch_row is None or "unavailable" in torch_row or "unavailable" in own:
                    reason = own.get("unavailable") or (torch_row or {}).get("unavailable", "not measured")
                    rows.append([model_name, attention, generation_label, reason] + [""] * (len(COLUMNS) - 4))
                    continue
                cells = [model_name, attention, generation_label, f"{torch_row['peak_bytes'] / 2**20:.0f}",
                         _ms(torch_row.get("estimate_s"))]
                for variant in (*ROUTED_VARIANTS, "no dropout"):
                    row = find(attention if variant != "no dropout" else REFERENCE_ATTENTION[attention], variant)
                    cells.append("—" if row is None or "unavailable" in row else
                                 f"{_ratio(row['peak_bytes'], torch_row['peak_bytes'])} / "
                                 f"{_ratio(row.get('estimate_s'), torch_row.get('estimate_s'))}"
                                 + ("" if "commit" in row or variant == "no dropout" else " †"))
                cells.append(own.get("tpu_custom_calls", "—"))
                rows.append(cells)
    layers = sorted({r["layers"] for r in records})
    notes = (
        "One training step (forward, loss, backward; outputs: loss and every gradient, float32) of each model, "
        f"{' or '.join(map(str, layers))} layers (the released models have 12; per layer the step repeats), every "
        f"dropout p={P}, compiled whole for one chip of each generation by libtpu's compile-only client on this CPU "
        "machine (`torch_pallas.tpu_compile.compile_graph`; built under `tpu_compile.lowering_for_tpu()`, never run). "
        "Models: " + "; ".join(f"{name}: {text}" for name, (text, _) in MODELS.items()) + ". "
        "Columns: `torch`: torch's dropout, its peak HBM and estimated step time; `default`: `route_dropout()` as a "
        "user gets it without options (the README's line): every dropout routed to torch_pallas with the default "
        "impl (`tiled`), residual adds, eager attention's products of dropped weights and values and linear layers "
        "of at most 128 output features after a dropout fused (the defaults since 2026-12-01); `threefry`, "
        "`hardware`, `tiled`: the same with that noise impl (`impl=`, docs/noise.md; "
        "`route_dropout(impl=..., fuse_residual=True, fuse_matmul=True)`: `tiled` is `default`'s program); "
        "`tiled linear`: every linear layer after a dropout "
        "fused, nothing else (`route_dropout(fuse_linear=True)`: T5's `wo(dropout(h))` of 768 features, the "
        "evidence for the default's bound); `threefry unfused`, `tiled unfused`: nothing fused "
        "(`route_dropout(impl=..., fuse_linear=False, fuse_residual=False, fuse_matmul=False)`, what a user got "
        "without options before 2026-11-29); "
        "each ratio cell is "
        "peak HBM (`peak_memory_in_bytes`) / estimated step time (`GraphCompilation.estimate`) as ratios to "
        "torch's (below 1.0x: less than torch's); "
        "`no dropout`: the model in eval mode; kernels: the Mosaic custom calls in the torch_pallas step. "
        "Attention `torch_pallas`: the model built with "
        "`attn_implementation=\"torch_pallas\"` (`register_attention()`: flash kernels, in-kernel dropout), its "
        "ratios against eager attention with torch's dropout. Compiler estimates, not TPU measurements. Rows come "
        "from several runs (`--models`/`--variants`/`--generations` subsets), some side by side: compile-only "
        "figures do not depend on the machine's load.\n\n")
    torchax_rows = [r for r in records if _stack_of(r) == "torchax" and "versions" in r]
    if torchax_rows:
        packages = ", ".join(f"{name} {version}" for name, version in torchax_rows[-1]["versions"].items())
        notes += ("Generations marked (torchax): measured on the torchax stack (" + packages + "), whose libtpu "
                  "knows TPU7x (torch_xla's does not): the step is a JAX function (`step_function`: torchax's "
                  "`JittableModule` under `jax.value_and_grad`, the backward kernels the ops' own) compiled by "
                  "`tpu_compile.analyze_for_tpu`. There `torch` is torchax's dropout: `jax.random` threefry bits "
                  "drawn by XLA inside the step, from the step's key.\n\n")
    notes += _above_torch_note(records) + _lora_note(records)
    unestimated = {}
    for r in records:
        if r.get("unestimated"):
            unestimated.setdefault(r["unestimated"], set()).add(f"{r['model']} {r['attention']} {r['generation']}")
    for reason, rows_of_reason in sorted(unestimated.items()):
        notes += f"Not estimated (—) for {', '.join(sorted(rows_of_reason))}: {reason}.\n\n"
    if any("commit" not in r for r in records if r.get("variant", "").startswith("torch_pallas") and "peak_bytes" in r):
        notes += (f"†: measured before {KEY_VALUE_TRANSPOSED}, with kernels that read key and value as (S, E) planes "
                  "(a head dim of 64 in 128-lane rows) wherever; they now read them transposed where one block holds "
                  "every key (BERT's, ViT's and T5's attention, eager attention's products), so there these figures "
                  "are not the current kernels'. GPT-2's flash kernels (1024 keys, two blocks) read them as before: "
                  "its `sdpa` step measured again on v4 gives the same peak and step time.\n\n")
    same = sorted({f"{r['model']} {r['attention']} {r['variant']} = {r['same_graph_as']}"
                   for r in records if r.get("same_graph_as")})
    if same:
        notes += ("The same program (one HLO, `graph_digest`), so the same figures, not compiled again: "
                  + "; ".join(same) + ".\n\n")
    return notes + markdown_table(COLUMNS, rows) + render_breakdown(records)


def _above_torch_note(records: list) -> str:
    """The rule's cells above torch's (:data:`RULE_VARIANT` on :data:`RULE_GENERATIONS`, the xla stack's
    libtpu): those the newer libtpu compiled too (tpu_step_newer_libtpu), with its ratio and their
    cause, and the others apart; "" when none is above."""
    by = {_key(r): r for r in records}
    newer = json.loads(NEWER_LIBTPU_PATH.read_text())["results"] if NEWER_LIBTPU_PATH.exists() else []
    newer_peaks = {(r["model"], r["layers"], r["attention"], r["variant"], r["generation"]): r["newer_peak_bytes"]
                   for r in newer}
    explained, unexplained = [], []
    for r in records:
        if (r["variant"] != RULE_VARIANT or r["generation"] not in RULE_GENERATIONS or _stack_of(r) != "xla"
                or "peak_bytes" not in r):
            continue
        torch_row = by.get((r["model"], REFERENCE_ATTENTION[r["attention"]], "torch", r["generation"], "xla"))
        if torch_row is None or "peak_bytes" not in torch_row:
            continue
        above = [f"{name} {_ratio(r.get(field), torch_row.get(field))}" for name, field in
                 (("peak", "peak_bytes"), ("step", "estimate_s"))
                 if r.get(field) and torch_row.get(field) and round(r[field] / torch_row[field], 2) > 1.0]
        if not above:
            continue
        place = (r["model"], r["layers"], r["attention"])
        newer_own = newer_peaks.get((*place, r["variant"], r["generation"]))
        newer_torch = newer_peaks.get((*place, "torch", r["generation"]))
        cell = f"{r['model']} {r['attention']} {r['generation']} ({', '.join(above)}"
        if newer_own and newer_torch:
            explained.append(cell + f"; peak {newer_own / newer_torch:.3f}x under the newer libtpu)")
        else:
            unexplained.append(cell + ")")
    note = ""
    if explained:
        note += (f"Above torch's with `{label(RULE_VARIANT)}` on {', '.join(RULE_GENERATIONS)}: {'; '.join(explained)}. "
                 "Their cause is libtpu 0.0.21's placement and schedule of those programs (torch_xla 2.9 pins it): "
                 "the gradients our backward kernels output wait for the weight-gradient products, which it runs "
                 "last, in HBM where torch's step keeps its own in VMEM, and at the released 12 layers it runs every "
                 "product after our last kernel. The torchax stack's newer libtpu compiles the same HLOs below "
                 "torch's peak (tpu_step_newer_libtpu.md; docs/benchmarks/index.md), and the default impl's rule is "
                 "judged with the newest libtpu a stack runs.\n\n")
    if unexplained:
        note += (f"Also above torch's with `{label(RULE_VARIANT)}`, not compiled by the newer libtpu: "
                 f"{'; '.join(unexplained)}: the breakdown below says where their time goes.\n\n")
    return note


def _lora_note(records: list) -> str:
    """The Llama-style LoRA rows against no dropout (issue 62's target: at most 1.02x), each with the
    least its masks' noise can cost (every mask drawn twice, forward and backward, at the vector
    units' peak: :func:`common.mask_noise_floor_seconds`) as a share of the no-dropout step."""
    by = {_key(r): r for r in records}
    cells = []
    for r in records:
        elements = llama_lora_mask_elements(r["model"], r["layers"])
        if elements is None or r["variant"] != RULE_VARIANT or _stack_of(r) != "xla" or not r.get("estimate_s"):
            continue
        floor = by.get((r["model"], r["attention"], "no dropout", r["generation"], "xla"))
        if floor is None or not floor.get("estimate_s"):
            continue
        noise = mask_noise_floor_seconds(r["generation"], 2 * elements)
        cells.append(f"{r['model']} {r['generation']}: peak {_ratio(r['peak_bytes'], floor['peak_bytes'])}, "
                     f"step {_ratio(r['estimate_s'], floor['estimate_s'])}, noise floor "
                     f"{noise / floor['estimate_s']:.1%} of the step")
    if not cells:
        return ""
    return (f"Llama-style LoRA rows, `{label(RULE_VARIANT)}` (what `route_dropout()` gives them) against no dropout, "
            "with the least the masks' noise costs as a share of the no-dropout step (every adapted layer's input "
            "masked twice, forward and backward, at the vector units' peak: `common.mask_noise_floor_seconds`): "
            + "; ".join(cells) + ". Where that floor is 2 % or more, no kernel drawing the tiled impl's 13-round "
            "hash brings the step within 1.02x of no dropout. The fused kernels cost their memory traffic plus that "
            "floor (tpu_cost_lora.md); XLA's own ops together take no longer than without dropout, but llama-lora's "
            "copies on v5e and v6e (the breakdown below).\n\n")


COLUMNS = ("model", "attention", "generation", "torch: peak HBM (MiB)", "torch: step (ms)",
           *(f"{label(variant)} / torch: peak / step" for variant in ROUTED_VARIANTS),
           "no dropout / torch: peak / step", "kernels")


def place_label(generation: str, stack_name: str) -> str:
    """A generation as the tables name it: the torchax stack's marked, its libtpu not the xla stack's."""
    return generation if stack_name == "xla" else f"{generation} ({stack_name})"


def render_breakdown(records: list) -> str:
    """Where the estimated step time goes (:func:`breakdown`), for every place whose ``torch`` row
    records it, each variant measured there beside it; "" when none does."""
    by = {_key(r): r for r in records}
    rows = []
    for model_name in MODELS:
        for attention in ATTENTIONS:
            for torch_row in [r for r in records if r["model"] == model_name and r["variant"] == "torch"
                              and r["attention"] == REFERENCE_ATTENTION[attention] and "seconds_by_kind" in r]:
                place = model_name, attention, torch_row["generation"], _stack_of(torch_row)
                for variant in ("torch", *ROUTED_VARIANTS):
                    row = torch_row if variant == "torch" else by.get((*place[:2], variant, *place[2:]))
                    if row is None or "seconds_by_kind" not in row:
                        continue
                    kinds = row["seconds_by_kind"]
                    cells = [model_name, attention, place_label(*place[2:]), label(variant),
                             _ms(row["estimate_s"])]
                    for kind in ("kernel", "fusion"):
                        part = kinds.get(kind, {"ops": 0, "seconds": 0.0, "schedule_bound_s": 0.0})
                        cells.append(f"{part['ops']}: {_us(part['seconds'])} ({_us(part['schedule_bound_s'])})")
                    cells += [_us(kinds.get("copy", {}).get("seconds", 0.0)), _us(kinds["program"]["seconds"])]
                    rows.append(cells)
    if not rows:
        return ""
    return ("\nWhere the estimated step time goes (step in ms, its parts in µs), for the places measured with this "
            "breakdown: the Mosaic kernels and XLA's fusions as count: time (the part of it in ops whose bundles "
            "take longer than their HBM traffic, i.e. bound by their schedule, not their bytes), the async copies, "
            "and the top-level program's own bundles (launching every op).\n\n" + markdown_table(
                ["model", "attention", "generation", "variant", "step (ms)", "kernels: count: µs (schedule-bound)",
                 "fusions: count: µs (schedule-bound)", "copies (µs)", "top-level program (µs)"], rows))


def _ms(seconds):
    return "—" if seconds is None else f"{seconds * 1e3:.2f}"


def _us(seconds):
    return f"{seconds * 1e6:.0f}"


def _ratio(value, reference):
    return "—" if value is None or not reference else f"{value / reference:.2f}x"


def run(full: bool, models=None, attentions=ATTENTIONS, variants=VARIANTS, generations=None, layers=LAYERS) -> str:
    """Compiles the steps (full: every model for every generation; quick: GPT-2 for v5e) and
    writes results/tpu_step.{json,md}, keeping the committed rows a partial run did not redo."""
    from torch_pallas import tpu_compile

    if not tpu_compile.available():
        return "skipped: libtpu is not installed (./dev installs it with the test extra)"
    try:
        import transformers  # noqa: F401
    except ImportError:
        return "skipped: transformers is not installed (the test extra installs it)"
    start = time.perf_counter()
    models = models or (list(MODELS) if full else ["gpt2"])
    generations = generations or (list(tpu_compile.GENERATIONS) if full else ["v5e"])
    table = save(measure_all(models, attentions, variants, generations, layers))
    print(f"{time.perf_counter() - start:.0f} s", file=sys.stderr)
    return table


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", choices=list(MODELS))
    parser.add_argument("--attentions", nargs="*", default=list(ATTENTIONS))
    parser.add_argument("--variants", nargs="*", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--generations", nargs="*")
    parser.add_argument("--layers", type=int, default=LAYERS)
    options = parser.parse_args()
    from torch_pallas import tpu_compile

    tpu_compile.enable_estimates()
    print(run(True, options.models, options.attentions, options.variants, options.generations, options.layers))


if __name__ == "__main__":
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile only: torchax's JAX would otherwise try libtpu first
    import torch_pallas  # noqa: F401  (torch_xla before JAX)

    main()
