"""Compile JAX functions (the kernels included) for real TPUs on a machine without one.

libtpu's compile-only client (``jax.experimental.topologies``) gives TPU devices of a named
topology, and ``jax.jit(f).lower(...).compile()`` on them runs XLA's TPU compiler and
Mosaic's own passes: what a TPU would reject (unsupported types, layouts, VMEM overflow)
fails here too. ``jax.export`` stops before those passes and passed kernels that libtpu
rejects. Needs the ``libtpu`` package (``pip install torch-pallas[test]``); importing
:mod:`torch_pallas` pins the Mosaic IR version libtpu accepts (see :mod:`torch_pallas.bridge`).

Example::

    >>> from torch_pallas.kernels import sampling
    >>> from torch_pallas.tpu_compile import compile_for_tpu
    >>> key_data = jax.ShapeDtypeStruct((2,), jnp.int32)
    >>> compile_for_tpu(functools.partial(sampling.uniform, shape=(8, 128), interpret=False),
    ...                 key_data, generation="v5e")
"""

from __future__ import annotations

import functools
import importlib.util

import jax

# One topology name per generation: the smallest each accepts ("v5e:1x1" is refused, and
# libtpu 0.0.21 does not know v7x).
GENERATIONS = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}


def available() -> bool:
    """Whether libtpu, the TPU compiler, is installed."""
    return importlib.util.find_spec("libtpu") is not None


@functools.cache
def tpu_device(generation: str):
    """One compile-only TPU device of ``generation`` (a key of :data:`GENERATIONS`)."""
    from jax.experimental import topologies

    if generation not in GENERATIONS:
        raise ValueError(f"generation must be one of {', '.join(map(repr, GENERATIONS))}, got {generation!r}")
    return topologies.get_topology_desc(topology_name=GENERATIONS[generation], platform="tpu").devices[0]


def compile_for_tpu(function, *args: jax.ShapeDtypeStruct, generation: str):
    """Compiles ``function(*args)`` for one TPU of ``generation`` and returns the compiled
    executable (it cannot run here).

    Raises:
        ValueError: an unknown ``generation``.
        jax.errors.JaxRuntimeError: what libtpu's compiler rejects, with its message
            (for example ``RESOURCE_EXHAUSTED ... Exceeded vmem capacity``).
    """
    sharding = jax.sharding.SingleDeviceSharding(tpu_device(generation))
    on_tpu = [jax.ShapeDtypeStruct(arg.shape, arg.dtype, sharding=sharding) for arg in args]
    return jax.jit(function).lower(*on_tpu).compile()


def compile_sharded_for_tpu(function, in_specs, out_specs, *args: jax.ShapeDtypeStruct, generation: str):
    """Compiles ``function`` as it runs on sharded tensors: under ``shard_map`` over the 4
    chips of ``generation``'s 2x2 topology (mesh axes ``("data", "model")``), each chip
    running ``function`` on its shards of ``args`` (global shapes, split as ``in_specs``
    say). The same per-shard program torch_xla runs under manual sharding.

    Raises:
        ValueError, jax.errors.JaxRuntimeError: as :func:`compile_for_tpu`.
    """
    import numpy as np
    from jax.sharding import Mesh, NamedSharding

    tpu_device(generation)  # checks the name
    from jax.experimental import topologies
    devices = topologies.get_topology_desc(topology_name=GENERATIONS[generation], platform="tpu").devices
    mesh = Mesh(np.array(devices[:4]).reshape(2, 2), ("data", "model"))
    on_tpu = [jax.ShapeDtypeStruct(arg.shape, arg.dtype, sharding=NamedSharding(mesh, spec))
              for arg, spec in zip(args, in_specs)]
    per_shard = jax.shard_map(function, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_specs, check_vma=False)
    return jax.jit(per_shard).lower(*on_tpu).compile()
