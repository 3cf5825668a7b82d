"""transformers' GPT-2 under tensor parallelism, sequence parallelism and FSDP2, with torch_pallas
dropout and attention, on CPU processes.

GPT-2's projections are transformers' ``Conv1D`` (a weight of ``(in, out)``), which torch's
``ColwiseParallel`` and ``RowwiseParallel`` do not take: the two styles below split a Conv1D as
those split an ``nn.Linear``. Its attention projects q, k and v in one Conv1D (``c_attn``),
whose columns are reordered so that each rank's shard holds its own heads' q, k and v
(Megatron's layout), and each rank's attention splits its shard in three. The attention runs in
torch_pallas's kernels on the rank's heads taken as their DTensor (``DTensor.from_local``,
split along the heads), so its dropout draws its part of the one-process mask; the embedding,
residual and MLP dropouts, converted, sit in the sequence-parallel regions and get DTensors.
Beside it every rank trains the same GPT-2 in one process, on both halves of each batch from the
same seed, as ``train_tensor_parallel.py`` does: losses and gradients agree to float32 rounding.

    python examples/train_gpt2_tensor_parallel.py                        # 4 processes, a 2 x 2 mesh
    torchrun --nproc-per-node 4 examples/train_gpt2_tensor_parallel.py   # the same, started by torchrun
"""

import functools
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from train_tensor_parallel import launch, train_side_by_side  # noqa: E402  (the processes, the training)

os.environ.setdefault("PJRT_DEVICE", "CPU")

VOCABULARY, WIDTH, HEADS = 64, 64, 4
# The attention implementation of the parallel model: torch_pallas's of its DTensor heads.
ATTENTION_OF_LOCAL_HEADS = "torch_pallas_local_heads"


class GPT2Loss(torch.nn.Module):
    """A small GPT-2 (transformers' ``GPT2LMHeadModel``, its dropouts 0.1), every dropout
    converted and its attention torch_pallas's: ``model(ids)`` is the language-model loss."""

    def __init__(self):
        import torch_pallas
        import transformers

        super().__init__()
        torch_pallas.register_attention()
        config = transformers.GPT2Config(vocab_size=VOCABULARY, n_positions=32, n_embd=WIDTH, n_layer=2,
                                         n_head=HEADS, attn_implementation="torch_pallas")
        torch.manual_seed(0)
        self.lm = torch_pallas.convert_dropout(transformers.GPT2LMHeadModel(config))

    def forward(self, ids):
        return self.lm(input_ids=ids, labels=ids, use_cache=False).loss


def attention_of_local_heads(module, query, key, value, attention_mask, *args, **kwargs):
    """transformers' attention function for a rank's heads (``(batch, heads / tp, L, E)``):
    torch_pallas's attention of the DTensors they are the shards of, split along the heads on
    the module's ``tp_mesh``, so that its dropout draws the one-process mask; returns the rank's
    heads of the output."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch_pallas.transformers_attention import attention_forward

    mesh = module.tp_mesh
    heads = [DTensor.from_local(tensor, mesh, [Shard(1)], run_check=False) for tensor in (query, key, value)]
    mask = None if attention_mask is None else DTensor.from_local(attention_mask, mesh, [Replicate()], run_check=False)
    output, weights = attention_forward(module, *heads, mask, *args, **kwargs)
    return output.to_local(), weights


def register_attention_of_local_heads() -> None:
    import transformers

    transformers.AttentionInterface.register(ATTENTION_OF_LOCAL_HEADS, attention_of_local_heads)
    masks = getattr(transformers, "AttentionMaskInterface", None)
    if masks is not None:
        masks.register(ATTENTION_OF_LOCAL_HEADS, masks._global_mapping["sdpa"])


def conv1d_style(style):
    """``style`` (torch's ColwiseParallel or RowwiseParallel) for transformers' Conv1D, whose
    weight is an ``nn.Linear``'s transposed: colwise splits its columns (and the bias), rowwise
    its rows (the bias replicated). Built on torch's styles' input and output functions (private
    API of torch 2.9 and 2.14, the stacks' pins)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel

    colwise = isinstance(style, ColwiseParallel)

    def partition(name, module, mesh):
        for parameter, placement in (("weight", Shard(1) if colwise else Shard(0)),
                                     ("bias", Shard(0) if colwise else Replicate())):
            module.register_parameter(parameter, torch.nn.Parameter(
                distribute_tensor(getattr(module, parameter), mesh, [placement])))

    class Conv1DStyle(type(style)):
        def _apply(self, module, device_mesh):
            if not colwise:
                self.desired_input_layouts = (Shard(-1),)  # (as RowwiseParallel's for nn.Linear)
            return distribute_module(
                module, device_mesh, partition,
                functools.partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                functools.partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))

    converted = Conv1DStyle.__new__(Conv1DStyle)
    converted.__dict__.update(style.__dict__)
    return converted


def heads_order(tp: int) -> torch.Tensor:
    """``c_attn``'s columns ``[q | k | v]`` reordered so that rank r's shard of them holds its
    heads' ``[q_r | k_r | v_r]``."""
    share = WIDTH // tp
    return torch.cat([torch.arange(part * WIDTH + rank * share, part * WIDTH + (rank + 1) * share)
                      for rank in range(tp) for part in range(3)])


def parallelize(model: GPT2Loss, mesh) -> GPT2Loss:
    """torch's TP + SP recipe over ``mesh["tp"]`` with the Conv1D styles, the dropouts and the
    blocks' layer norms in the sequence-parallel regions (the embeddings' sum and the last norm
    whole: GPT-2 builds its causal mask from the one's length and views the other with it), then
    FSDP2 over ``mesh["dp"]``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput,
                                                   RowwiseParallel, SequenceParallel, parallelize_module)

    tp = mesh["tp"]
    register_attention_of_local_heads()
    gpt2 = model.lm.transformer
    order = heads_order(tp.size())
    with torch.no_grad():
        for block in gpt2.h:
            block.attn.c_attn.weight.copy_(block.attn.c_attn.weight[:, order])
            block.attn.c_attn.bias.copy_(block.attn.c_attn.bias[order])
    parallelize_module(model.lm, tp, {
        "transformer.wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "transformer.drop": PrepareModuleInputOutput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), output_layouts=(Shard(1),),
            desired_output_layouts=(Shard(1),), use_local_output=True),
        # GPT-2 views the last norm's output with its input's sequence length: the sequence whole.
        "transformer.ln_f": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                               use_local_output=True),
        "lm_head": ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    })
    model.lm.lm_head.weight = gpt2.wte.weight  # tied, as GPT-2's (both split along the vocabulary)
    model.lm.config._attn_implementation = ATTENTION_OF_LOCAL_HEADS
    for block in gpt2.h:
        parallelize_module(block, tp, {
            "ln_1": SequenceParallel(), "ln_2": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attn.c_attn": conv1d_style(ColwiseParallel()),
            "attn.c_proj": conv1d_style(RowwiseParallel(output_layouts=Shard(1))),
            "attn.resid_dropout": SequenceParallel(use_local_output=True),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.c_fc": conv1d_style(ColwiseParallel()),
            "mlp.c_proj": conv1d_style(RowwiseParallel(output_layouts=Shard(1))),
            "mlp.dropout": SequenceParallel(use_local_output=True),
        })
        block.attn.split_size = WIDTH // tp.size()  # each rank's q, k and v
        block.attn.tp_mesh = tp
        fully_shard(block, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


def train(mesh, steps: int = 3, check_gradients: bool = False):
    """The parallel GPT-2 and a one-process one side by side (:func:`train_side_by_side`), each
    gradient of ``c_attn`` put back in GPT-2's column order to be compared."""
    inverse = torch.argsort(heads_order(mesh["tp"].size()))

    def full_gradient(name, gradient):
        if "c_attn" in name:
            return gradient[..., inverse]
        return gradient

    return train_side_by_side(mesh, GPT2Loss, parallelize, steps=steps, check_gradients=check_gradients,
                              vocabulary=VOCABULARY, full_gradient=full_gradient)


if __name__ == "__main__":
    launch(train)
    sys.exit(0)
