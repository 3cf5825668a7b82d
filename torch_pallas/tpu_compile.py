"""Compile JAX functions (the kernels included) for real TPUs on a machine without one.

libtpu's compile-only client (``jax.experimental.topologies``) gives TPU devices of a named
topology, and ``jax.jit(f).lower(...).compile()`` on them runs XLA's TPU compiler and
Mosaic's own passes: what a TPU would reject (unsupported types, layouts, VMEM overflow)
fails here too. ``jax.export`` stops before those passes and passed kernels that libtpu
rejects. Needs the ``libtpu`` package (``pip install torch-pallas[test]``); :data:`GENERATIONS` are
the generations it knows. Importing the kernels pins the Mosaic IR version where the JAX
version needs it (:mod:`torch_pallas.kernels.compat`). Importing this module imports neither
torch nor torch_xla (:func:`compile_graph` and :func:`lowering_for_tpu` are torch_xla's).

Example::

    >>> from torch_pallas.kernels import sampling
    >>> from torch_pallas.tpu_compile import compile_for_tpu
    >>> key_data = jax.ShapeDtypeStruct((2,), jnp.int32)
    >>> compile_for_tpu(functools.partial(sampling.uniform, shape=(8, 128), interpret=False),
    ...                 key_data, generation="v5e")

A whole torch graph (a training step, say) compiles the same way: build it under
:func:`lowering_for_tpu` (the kernels become TPU custom calls in the lazy graph; the graph
is never run here) and pass its outputs to :func:`compile_graph`::

    >>> with lowering_for_tpu():
    ...     loss = model(input_ids=ids, labels=ids).loss
    ...     loss.backward()
    >>> compiled = compile_graph([loss, *(p.grad for p in model.parameters())], "v5e")
    >>> compiled.peak_bytes, compiled.flops
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import time
from typing import Sequence

import jax

from torch_pallas.kernels import compat

# Each generation's smallest topology libtpu accepts ("v5e:1x1" is refused; TPU7x is
# "tpu7x", not "v7x"), oldest first. GENERATIONS keeps those the installed libtpu knows.
_TOPOLOGIES = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2", "tpu7x": "tpu7x:2x2x1"}


def available() -> bool:
    """Whether libtpu, the TPU compiler, is installed."""
    return importlib.util.find_spec("libtpu") is not None


def _topology(name: str):
    from jax.experimental import topologies

    return topologies.get_topology_desc(topology_name=name, platform="tpu")


@functools.cache
def _generations() -> dict[str, str]:
    """Asks libtpu which generations it knows (libtpu 0.0.21: v4 to v6e; 0.0.52: TPU7x too)."""
    if not available():
        return {}
    known = {}
    for generation, topology in _TOPOLOGIES.items():
        try:
            _topology(topology)
        except Exception:  # libtpu: INVALID_ARGUMENT "Invalid TPU external name"
            continue
        known[generation] = topology
    return known


def __getattr__(name):
    # Lazy: the first use asks libtpu for its topologies; importing this module does not.
    if name == "GENERATIONS":
        return _generations()
    if name in ("lowering_for_tpu", "LOWER_FOR_TPU_VARIABLE"):
        from torch_pallas import bridge  # imports torch: re-exported for compile_graph's users

        return getattr(bridge, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _check_generation(generation: str) -> str:
    generations = _generations()
    if generation not in generations:
        raise ValueError(f"generation must be one of {', '.join(map(repr, generations))} (the TPU generations "
                         f"the installed libtpu compiles for), got {generation!r}")
    return generations[generation]


@functools.cache
def _devices(generation: str) -> tuple:
    return tuple(_topology(_check_generation(generation)).devices)


def tpu_device(generation: str):
    """One compile-only TPU device of ``generation`` (a key of :data:`GENERATIONS`)."""
    return _devices(generation)[0]


def compile_for_tpu(function, *args: jax.ShapeDtypeStruct, generation: str):
    """Compiles ``function(*args)`` for one TPU of ``generation`` and returns the compiled
    executable (it cannot run here).

    Raises:
        ValueError: an unknown ``generation``.
        jax.errors.JaxRuntimeError: what libtpu's compiler rejects, with its message
            (for example ``RESOURCE_EXHAUSTED ... Exceeded vmem capacity``).
    """
    device = tpu_device(generation)
    sharding = jax.sharding.SingleDeviceSharding(device)
    on_tpu = [jax.ShapeDtypeStruct(arg.shape, arg.dtype, sharding=sharding) for arg in args]
    with compat.lowering_for_device(device):
        return jax.jit(function).lower(*on_tpu).compile()


def compile_sharded_for_tpu(function, in_specs, out_specs, *args: jax.ShapeDtypeStruct, generation: str):
    """Compiles ``function`` as it runs on sharded tensors: under ``shard_map`` over 4 devices
    of ``generation``'s smallest topology (mesh axes ``("data", "model")``), each running
    ``function`` on its shards of ``args`` (global shapes, split as ``in_specs`` say). The
    same per-shard program torch_xla runs under manual sharding.

    Raises:
        ValueError, jax.errors.JaxRuntimeError: as :func:`compile_for_tpu`.
    """
    import numpy as np
    from jax.sharding import Mesh, NamedSharding

    devices = _devices(generation)
    mesh = Mesh(np.array(devices[:4]).reshape(2, 2), ("data", "model"))
    on_tpu = [jax.ShapeDtypeStruct(arg.shape, arg.dtype, sharding=NamedSharding(mesh, spec))
              for arg, spec in zip(args, in_specs)]
    per_shard = jax.shard_map(function, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_specs, check_vma=False)
    with compat.lowering_for_device(devices[0]):
        return jax.jit(per_shard).lower(*on_tpu).compile()


@dataclasses.dataclass(frozen=True)
class GraphCompilation:
    """What libtpu's compiler reports for one graph on one TPU of ``generation``.

    Memory is per chip, in bytes, as the executable's ``get_compiled_memory_stats()`` gives
    it: ``peak_bytes`` is its ``peak_memory_in_bytes`` (libtpu's peak of HBM in use);
    ``temp_bytes`` the temporaries' allocation as buffer assignment sizes it (activations kept
    for the backward pass among them), which is not a part of the peak: on some generations
    it exceeds it, and it was 0 for small graphs. ``cost`` is ``cost_analysis()`` as libtpu
    gives it (``"flops"``, ``"bytes accessed"``, ``"transcendentals"``, per-operand entries).
    Compiler estimates, not measurements.
    """

    generation: str
    seconds: float
    peak_bytes: int
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    generated_code_bytes: int
    cost: dict

    @property
    def flops(self) -> float:
        return self.cost.get("flops", 0.0)

    @property
    def bytes_accessed(self) -> float:
        return self.cost.get("bytes accessed", 0.0)


def compile_graph(tensors: Sequence, generation: str) -> GraphCompilation:
    """Compiles the lazy XLA graph that computes ``tensors`` (XLA tensors, not yet
    computed) for one TPU of ``generation`` with libtpu, on any machine; nothing runs.

    The graph is the HLO torch_xla would run for ``tensors`` (a loss and its gradients, for
    a training step). Pallas kernels in it must be TPU custom calls: off TPU, build it under
    :func:`lowering_for_tpu`, or the kernels are the interpret-mode HLO of the CPU client
    (which compiles too, but is not what a TPU runs). Only unsharded graphs: SPMD graphs
    need the partitioner's options and a mesh of devices.

    Args:
        tensors: the XLA tensors whose graph to compile (its outputs).
        generation: a key of :data:`GENERATIONS`.

    Returns:
        :class:`GraphCompilation`: compile time, memory and cost analysis.

    Raises:
        ValueError: an unknown ``generation``, or a tensor that is not an XLA tensor.
        RuntimeError: libtpu is not installed.
        NotImplementedError: torch_xla is in SPMD mode.
        jax.errors.JaxRuntimeError: what libtpu's compiler rejects, with its message.
    """
    import torch_xla
    import torch_xla.runtime as xr
    from jax._src import compiler
    from jax._src.lib import xla_client

    if generation not in _TOPOLOGIES:
        raise ValueError(f"generation must be one of {', '.join(map(repr, _TOPOLOGIES))}, got {generation!r}")
    tensors = list(tensors)
    if not tensors or any(getattr(t, "device", None) is None or t.device.type != "xla" for t in tensors):
        raise ValueError("tensors must be a non-empty sequence of XLA tensors (on torch_xla.device())")
    if not available():
        raise RuntimeError("compile_graph needs libtpu, the TPU compiler: pip install 'torch-pallas[test]' "
                           "(libtpu==0.0.21, the version torch_xla[tpu] 2.9 pins)")
    if xr.is_spmd():
        raise NotImplementedError("compile_graph compiles unsharded graphs only; this process is in SPMD mode")
    device = tpu_device(generation)
    proto = torch_xla._XLAC._get_xla_tensors_hlo_proto(tensors)
    # jax 0.7.1's private converter (the jax pin keeps it): libtpu's client takes StableHLO.
    module = xla_client._xla.mlir.hlo_to_stablehlo(proto)
    options = compiler.get_compile_options(num_replicas=1, num_partitions=1)
    start = time.perf_counter()
    executable = device.client.compile(module, xla_client.DeviceList((device,)), options)
    seconds = time.perf_counter() - start
    memory = executable.get_compiled_memory_stats()
    cost = executable.cost_analysis()
    cost = dict(cost[0] if isinstance(cost, (list, tuple)) else cost)
    return GraphCompilation(
        generation=generation, seconds=seconds, peak_bytes=memory.peak_memory_in_bytes,
        argument_bytes=memory.argument_size_in_bytes, output_bytes=memory.output_size_in_bytes,
        temp_bytes=memory.temp_size_in_bytes, alias_bytes=memory.alias_size_in_bytes,
        generated_code_bytes=memory.generated_code_size_in_bytes, cost=cost)
