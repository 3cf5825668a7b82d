"""Tensor parallelism, sequence parallelism and FSDP2 with torch_pallas dropout, on CPU processes.

A small GPT (GPT-2's layout: embedding dropout, attention and MLP residual dropouts, on
``nn.Linear`` layers, which torch's tensor-parallel plans take) has its dropouts converted by
``torch_pallas.convert_dropout`` and is parallelized with torch's own recipe: tensor parallelism
with sequence parallelism (``parallelize_module``) over a mesh's "tp" dim, FSDP2
(``fully_shard``) over its "dp" dim. The dropouts sit in the sequence-parallel regions, where
each gets its shard as a DTensor and draws that shard's part of the whole tensor's mask. Beside
it every rank trains the same model in one process, on both halves of each batch from the same
seed: the losses printed side by side agree to float32 rounding, because every mask is the
single-process one.

    python examples/train_tensor_parallel.py                        # 4 processes, a 2 x 2 mesh
    torchrun --nproc-per-node 4 examples/train_tensor_parallel.py   # the same, started by torchrun

Each data-parallel rank trains on its half of the batch and seeds alike: its masks are those of
one process running that half from the step's seed (docs/sharding.md, DTensors).
"""

import os
import sys
import tempfile

import torch
import torch.distributed as dist

os.environ.setdefault("PJRT_DEVICE", "CPU")


class Attention(torch.nn.Module):
    def __init__(self, width: int, head_dim: int, p: float):
        super().__init__()
        self.head_dim = head_dim
        self.wq, self.wk, self.wv, self.wo = (torch.nn.Linear(width, width, bias=False) for _ in range(4))
        self.drop = torch.nn.Dropout(p)

    def forward(self, x):
        batch, length = x.shape[:2]
        # -1 heads: under tensor parallelism each rank holds its share of them
        q, k, v = (w(x).view(batch, length, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        heads = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.drop(self.wo(heads.transpose(1, 2).reshape(batch, length, -1)))


class FeedForward(torch.nn.Module):
    def __init__(self, width: int, p: float):
        super().__init__()
        self.w1, self.w2 = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)
        self.drop = torch.nn.Dropout(p)

    def forward(self, x):
        return self.drop(self.w2(torch.nn.functional.gelu(self.w1(x))))


class Block(torch.nn.Module):
    def __init__(self, width: int, head_dim: int, p: float):
        super().__init__()
        self.attention_norm, self.ffn_norm = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.attention, self.feed_forward = Attention(width, head_dim, p), FeedForward(width, p)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class TinyGPT(torch.nn.Module):
    """``checkpointed``: each block recomputed in the backward pass by torch_pallas.checkpoint,
    which draws the forward's masks again."""

    def __init__(self, vocabulary=64, width=64, head_dim=16, layers=2, p=0.1, checkpointed=False):
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(vocabulary, width)
        self.drop = torch.nn.Dropout(p)
        self.layers = torch.nn.ModuleList(Block(width, head_dim, p) for _ in range(layers))
        self.norm, self.output = torch.nn.LayerNorm(width), torch.nn.Linear(width, vocabulary, bias=False)
        self.checkpointed = checkpointed

    def forward(self, ids):
        import torch_pallas

        x = self.drop(self.tok_embeddings(ids))
        for layer in self.layers:
            x = torch_pallas.checkpoint(layer, x, use_reentrant=False) if self.checkpointed else layer(x)
        logits = self.output(self.norm(x))
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def parallelize(model: TinyGPT, mesh) -> TinyGPT:
    """torch's TP + SP recipe over ``mesh["tp"]`` (the plan of its tensor-parallel tutorial, the
    dropouts with their norms in the sequence-parallel regions), then FSDP2 over ``mesh["dp"]``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    tp = mesh["tp"]
    parallelize_module(model, tp, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "drop": SequenceParallel(use_local_output=True),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for layer in model.layers:
        parallelize_module(layer, tp, {
            "attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "attention.drop": SequenceParallel(use_local_output=True),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.drop": SequenceParallel(use_local_output=True),
        })
        fully_shard(layer, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


def train(mesh, steps: int = 3, checkpointed: bool = False, check_gradients: bool = False):
    """Trains the parallel model and a one-process copy side by side (:func:`train_side_by_side`)."""
    import torch_pallas

    def model():
        torch.manual_seed(0)
        return torch_pallas.convert_dropout(TinyGPT(checkpointed=checkpointed))

    return train_side_by_side(mesh, model, parallelize, steps=steps, check_gradients=check_gradients)


def train_side_by_side(mesh, model, parallelize, *, steps: int, check_gradients: bool, vocabulary: int = 64,
                       full_gradient=lambda name, gradient: gradient):
    """Trains ``parallelize(model(), mesh)`` and a one-process ``model()`` side by side, each step
    on a batch whose halves are the data-parallel ranks' (``model(ids)`` returns the loss);
    returns each step's ``(loss, the one-process loss on this rank's half)``.
    ``check_gradients``: every step, every parameter's gradient (gathered, then
    ``full_gradient(name, gradient)`` in the one-process model's layout) must equal the
    one-process model's (averaged over the halves, as FSDP2 averages them) within float32
    tolerance."""
    single, parallel = model(), parallelize(model(), mesh)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (single, parallel)]
    dp_rank, losses = mesh["dp"].get_local_rank(), []
    for step in range(steps):
        halves = torch.randint(0, vocabulary, (4, 32), generator=torch.Generator().manual_seed(step)).chunk(2)
        single_losses = []
        for half in halves:
            torch.manual_seed(100 + step)  # every rank, and each half of the one process, alike
            loss = single(half)
            (loss / len(halves)).backward()
            single_losses.append(loss.item())
        torch.manual_seed(100 + step)
        loss = parallel(halves[dp_rank])
        loss.backward()
        if check_gradients:
            for (name, want), got in zip(single.named_parameters(), parallel.parameters()):
                # A sharded product sums in another order: an element near zero carries the rounding of
                # the gradient's large terms, so the absolute tolerance follows the largest (1e-6 alone
                # failed by 1.07e-6 on one of GPT-2's 16384 weights on another CPU; 1e-4 of the largest
                # by 2.2e-6 = 2.7e-4 of it in one value feature of transformers' GPT-2 layer 0, 24 of
                # 12288 weights and its bias, with the tiled masks of 2026-12-02); a mask drawn
                # differently moves whole heads' elements by the size of the gradient itself.
                torch.testing.assert_close(full_gradient(name, got.grad.full_tensor()), want.grad, rtol=1e-4,
                                           atol=1e-3 * want.grad.abs().max().item(),
                                           msg=lambda message: f"{name}: {message}")
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        losses.append((loss.item(), single_losses[dp_rank]))
    return losses


def main(rank: int, world: int, init_method: str, train=train) -> None:
    """One process of the run: its share of ``train`` on a (2, world / 2) mesh ("dp", "tp")."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        for step, (loss, single) in enumerate(train(mesh)):
            if rank == 0:
                print(f"step {step}: loss {loss:.6f}   one process, the same half and seed: {single:.6f}")
    finally:
        dist.destroy_process_group()


def launch(train=train) -> None:
    """Runs ``train`` in 4 processes, or in this one as a rank of torchrun's."""
    if "RANK" in os.environ:  # started by torchrun
        main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", train)
    else:
        import torch.multiprocessing

        store = os.path.join(tempfile.mkdtemp(), "store")
        torch.multiprocessing.spawn(main, args=(4, f"file://{store}", train), nprocs=4)


if __name__ == "__main__":
    launch()
    sys.exit(0)
