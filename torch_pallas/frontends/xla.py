"""The torch_xla front end: lazy XLA tensors (``PJRT_DEVICE=CPU`` or ``TPU``).

The only module that touches torch_xla (besides :func:`torch_pallas.tpu_compile.compile_graph`,
which reads a whole lazy graph). A kernel becomes one node of the lazy XLA graph: lowered
by JAX once per function, static configuration and input shapes, then applied with one
torch_xla call (what ``call_jax`` does, without its per-call work). SPMD-sharded tensors
run their kernels per shard under manual sharding (:func:`call_sharded`).
"""

from __future__ import annotations

import functools
import math
import os
from typing import Sequence

import numpy as np
import torch
import torch_xla
import torch_xla.runtime as xr
from torch_xla._internal.jax_workarounds import jax_import_guard

# On TPU, torch_xla's PJRT client must own the chips before JAX initialises, or XLA
# operations hang; this module is imported before anything that imports JAX.
jax_import_guard()

import torch_xla.core.xla_builder as xb  # noqa: E402  (after the guard)
import torch_xla.distributed.spmd as xs  # noqa: E402
import torch_xla.utils.checkpoint as xla_checkpoint  # noqa: E402
from jax._src import config as _jax_config  # noqa: E402

from torch_pallas import bridge  # noqa: E402
# Importing the kernels pins the Mosaic IR version libtpu 0.0.21 accepts (kernels.compat).
from torch_pallas import kernels  # noqa: E402,F401
from torch_pallas.sharding import Sharding, with_shard_offset  # noqa: E402


IMPLEMENTS = (bridge.FrontEnd, bridge.ShardingFrontEnd, bridge.GraphCompilingFrontEnd)
DEVICE_DESCRIPTION = "an XLA device (torch_xla.device())"
MOVE_HINT = "torch_xla.device()"
# torch_xla 2.9 raises for a torch.Generator on an XLA device.
GENERATOR_DEVICE_TYPES = ("cpu",)
GENERATORS = "a CPU torch.Generator"
SEEDED_BY = "torch_xla.manual_seed"
CHECKPOINT_FUNCTIONS = (xla_checkpoint.CheckpointFunction,)


def _keep_jax_on_cpu_with_the_cpu_client() -> None:
    """On ``PJRT_DEVICE=CPU`` JAX needs only its CPU backend. Without this, an installed
    libtpu (the test extra's TPU compiler) makes JAX try to start a TPU backend at its
    first use and print libtpu's initialisation errors. An explicit ``JAX_PLATFORMS`` wins;
    libtpu's compile-only TPU devices (:mod:`torch_pallas.tpu_compile`) work either way."""
    if xr.device_type() == "CPU" and not os.environ.get("JAX_PLATFORMS"):
        import jax

        jax.config.update("jax_platforms", "cpu")


_keep_jax_on_cpu_with_the_cpu_client()


def platform_is_tpu() -> bool:
    """Whether the XLA device is a TPU (``PJRT_DEVICE=TPU``)."""
    return xr.device_type() == "TPU"


def runs_lazily(tensor: torch.Tensor) -> bool:
    """Lazy unless torch_xla's eager mode (``torch_xla.experimental.eager_mode``) is on."""
    return not torch_xla._XLAC._get_use_eager_mode()


def compile_aot_graph(graph_module: torch.fx.GraphModule, example_inputs):
    """An AOTAutograd graph compiled as torch.compile's ``"openxla"`` backend compiles it."""
    from torch._dynamo.backends.torchxla import openxla_eval_boxed

    return openxla_eval_boxed(graph_module, example_inputs)


@torch.compiler.assume_constant_result  # dynamo cannot trace into torch_xla's C++ bindings
def default_device() -> torch.device:
    return torch_xla.device()


def check_device_usable(device: torch.device) -> None:
    """XLA tensors can always be made."""


def register_op(op, compute, formula) -> None:
    """XLA tensors reach a custom op through torch's dispatcher, which knows it already."""


def defer_function_to_mode(func, mode_type) -> None:
    """torch_xla takes no torch function before torch's mode stack does."""


def draw_key_words(device: torch.device) -> torch.Tensor:
    """Two int32 words from the XLA RNG (``torch_xla.manual_seed``), with no host sync and no
    new graph per call."""
    return bridge.torch_key_words(device)


# (function, interpret (the platform), static values in the caller's order, JAX's trace
# context, input shapes and dtypes) -> the lowered computation and whether it returns one
# array (else a tuple of them). call_jax keeps such a cache too, but reaches it
# through pytree flattening and sixteen environment-variable contexts on every call; here a
# call after the first is a dictionary lookup and one torch_xla call.
_COMPUTATIONS: dict = {}


def call(jax_function, tensors, static: dict):
    """``jax_function(*tensors, **static)`` as one node of the lazy XLA graph: lowered once per
    key (for TPU when :func:`torch_pallas.bridge.lowers_for_tpu`, else for JAX's backend
    beside the client, the CPU) and applied with torch_xla's ``_xla_user_computation``, the
    call ``call_jax`` ends in (torch_xla 2.9's C++ binding, kept by the pin; ``call_jax``
    uses it the same way)."""
    interpret = not bridge.lowers_for_tpu()
    key = (jax_function, interpret, *static.items(), _jax_config.trace_context(),
           *[(tensor.shape, tensor.dtype) for tensor in tensors])
    lowered = _COMPUTATIONS.get(key)
    if lowered is None:
        lowered = _COMPUTATIONS[key] = _lower(jax_function, tensors, dict(static, interpret=interpret),
                                              None if interpret else "tpu")
    computation, single = lowered
    outputs = torch_xla._XLAC._xla_user_computation("xla::torch_pallas", list(tensors), computation)
    return outputs[0] if single else tuple(outputs)


def _lower(jax_function, tensors, static: dict, platform):
    """The XLA computation of ``jax_function`` for ``tensors``' shapes and dtypes, and whether
    it returns one array (else a tuple or list of them)."""
    import jax
    import jax.numpy as jnp
    from torch_xla._internal.jax_workarounds import jax_env_context

    trees = []

    def flat(*arrays):
        leaves, tree = jax.tree.flatten(jax_function(*arrays, **static))
        trees.append(tree)
        return leaves

    arguments = [jax.ShapeDtypeStruct(tuple(tensor.shape), jnp.dtype(str(tensor.dtype).removeprefix("torch.")))
                 for tensor in tensors]
    with jax_env_context():  # what call_jax sets around JAX on torch_xla's clients
        traced = jax.jit(flat, keep_unused=True).trace(*arguments)
        lowered = traced.lower(lowering_platforms=(platform,)) if platform else traced.lower()
        proto = lowered.compiler_ir("hlo").as_serialized_hlo_module_proto()
    return xb.computation_from_module_proto("torch_pallas", proto), trees[0].num_nodes == 1


def check_use_reentrant(use_reentrant) -> None:
    if use_reentrant is False:
        raise ValueError("use_reentrant=False is not available on XLA (torch_xla 2.9 checkpoints "
                         "reentrantly only): pass use_reentrant=True or leave it out")


def checkpoint(region, *args, use_reentrant, preserve_rng_state):
    """torch_xla's checkpoint (reentrant, with the optimisation barrier XLA needs so that the
    recomputation is not merged with the forward): ``torch.utils.checkpoint`` fails on XLA
    tensors."""
    check_use_reentrant(use_reentrant)
    return xla_checkpoint.checkpoint(region, *args, preserve_rng_state=preserve_rng_state)


# SPMD (torch_xla's xr.use_spmd()). XLA's partitioner cannot split a Mosaic kernel: given a
# sharded tensor it would gather the tensor onto every chip and run the kernel whole on each.
# So an op whose input is sharded runs its kernel under manual sharding instead: each device
# gets its own shard (xs.enable_manual_sharding), the kernel runs on it, and the shards are
# put back together with the input's sharding (xs.disable_manual_sharding), with no
# all-gather. A sharding is carried as torch_xla's own text for it (what
# torch_xla._XLAC._get_xla_sharding_spec returns).

def sharding_of(tensor: torch.Tensor) -> Sharding | None:
    """``tensor``'s sharding as torch_xla knows it now: set by ``xs.mark_sharding``, or
    propagated by XLA into a tensor it computed and materialised. ``None`` outside SPMD
    mode, and for a replicated tensor or one whose sharding XLA has not decided yet."""
    if not xr.is_spmd():
        return None
    return Sharding.parse(torch_xla._XLAC._get_xla_sharding_spec(tensor), tensor.dim())


def sharding_from_mesh(mesh, partition_spec: Sequence) -> Sharding | None:
    """The sharding ``xs.mark_sharding(t, mesh, partition_spec)`` gives ``t``.

    Raises:
        ValueError: SPMD mode is off.
    """
    if not xr.is_spmd():
        raise ValueError("mesh and partition_spec need SPMD mode: call torch_xla.runtime.use_spmd() first")
    # torch_xla's own translation, so the result is exactly what mark_sharding would apply:
    # the mesh permuted to (axes of the split dims in order, the other axes).
    spec = xs.xla_sharding._translate_named_partition_spec(mesh, tuple(partition_spec))
    assignment = xs.xla_sharding._get_tile_assignment(mesh, spec)
    split = iter(assignment.shape)
    tiles = tuple(1 if entry is None else next(split) for entry in spec)
    if all(size == 1 for size in tiles):
        return None
    return Sharding(tiles, tuple(int(i) for i in assignment.reshape(-1)), math.prod(split))


def is_mesh(mesh) -> bool:
    return isinstance(mesh, xs.Mesh)


MESH_TYPE_NAME = "torch_xla.distributed.spmd.Mesh"


# Every call of an op on a sharded tensor needs these; computed once per sharding (and one
# Mesh object per sharding keeps torch_xla's own per-mesh cache of OpShardings warm).
@functools.lru_cache(maxsize=None)
def _parsed(sharding_text: str) -> tuple[Sharding, xs.Mesh]:
    sharding = Sharding.parse(sharding_text)
    return sharding, xs.Mesh(np.array(sharding.device_ids), sharding.mesh_shape)


@functools.lru_cache(maxsize=None)
def _text_of_dims(sharding_text: str, dims: tuple) -> str:
    """torch_xla's text for a tensor split as ``dims`` say over ``sharding_text``'s mesh."""
    wanted = sharding_from_mesh(_parsed(sharding_text)[1], dims)
    return "{replicated}" if wanted is None else wanted.text


def _enter(tensor: torch.Tensor, dims: tuple, sharding_text: str) -> torch.Tensor:
    """Each device's shard of ``tensor`` split as ``dims`` say, in manual sharding mode.

    ``xs.enable_manual_sharding`` marks the tensor it is given; unless the tensor is already
    sharded so, that is a new value, so that the caller's tensor (a parameter, an initial
    state) keeps its own sharding and XLA moves the data between the two."""
    if torch_xla._XLAC._get_xla_sharding_spec(tensor) != _text_of_dims(sharding_text, dims):
        # Not clone(): torch_xla's clone keeps the sharding annotation (an FSDP-sharded
        # weight's, say), and marking it again then fails.
        tensor = tensor + 0
    return xs.enable_manual_sharding(tensor, dims, mesh=_parsed(sharding_text)[1]).global_tensor


def call_sharded(jax_function, sharding_text: str, tensors, in_dims, out_dims, noise_shape, static: dict):
    """:func:`torch_pallas.bridge.call_sharded` on XLA tensors: each device's shards in manual
    sharding mode, the outputs put back together with no all-gather."""
    sharding, mesh = _parsed(sharding_text)
    local = [_enter(tensor, tuple(dims), sharding_text) for tensor, dims in zip(tensors, in_dims)]
    if noise_shape is not None:
        key_data, *rest = local
        # Data, not a constant of the graph: every shard runs the same program.
        offsets = torch.from_numpy(sharding.shard_offset_words(
            noise_shape, static.get("shared_over_first_dim", False))).to(key_data.device)
        offsets = _enter(offsets, (*range(len(sharding.mesh_shape)), None), sharding_text)
        local = [key_data, offsets, *rest]
        static = dict(static, kernel=jax_function, global_shape=tuple(noise_shape))
        jax_function = with_shard_offset
    outputs = call(jax_function, local, static)
    single = isinstance(outputs, torch.Tensor)
    outputs = (outputs,) if single else tuple(outputs)
    full = []
    for output, dims in zip(outputs, out_dims):
        shape = tuple(size * (1 if d is None else sharding.tiles[d]) for size, d in zip(output.shape, dims))
        full.append(xs.disable_manual_sharding(output, tuple(dims), shape, mesh=mesh).global_tensor)
    return full[0] if single else tuple(full)


def sum_rows_in_order(rows: torch.Tensor, sharding_text: str, dims: tuple, like: torch.Tensor) -> torch.Tensor:
    """:func:`torch_pallas.bridge.sum_rows_in_order` on XLA tensors: the rows gathered onto
    every device (an all-gather of this small tensor only) and summed there."""
    mesh = _parsed(sharding_text)[1]
    gathered = xs.mark_sharding(rows.clone(), mesh, (None, *dims[1:])).global_tensor
    total = gathered.sum(0)
    target = sharding_of(like)
    if target is None:
        return xs.mark_sharding(total, mesh, (None,) * total.dim()).global_tensor
    return xs.mark_sharding(total, _parsed(target.text)[1], tuple(range(total.dim()))).global_tensor
