"""Compile JAX functions (the kernels included) for real TPUs on a machine without one.

libtpu's compile-only client (``jax.experimental.topologies``) gives TPU devices of a named
topology, and ``jax.jit(f).lower(...).compile()`` on them runs XLA's TPU compiler and
Mosaic's own passes: what a TPU would reject (unsupported types, layouts, VMEM overflow)
fails here too. ``jax.export`` stops before those passes and passed kernels that libtpu
rejects. Needs the ``libtpu`` package (``pip install libtpu``, in the ``test`` extra); :data:`GENERATIONS` are
the generations it knows. Importing the kernels pins the Mosaic IR version where the JAX
version needs it (:mod:`torch_pallas.kernels.compat`). Only :func:`compile_graph` and
:func:`lowering_for_tpu` (torch_xla's) need torch, and import it when called: in a process
without torch this module imports alone. Where torch is installed, importing any part of
torch_pallas imports torch first (the package starts torch_xla's client before JAX: :mod:`torch_pallas`).

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

With :func:`enable_estimates` called first, ``compile_graph(..., estimate=True)`` and
:func:`analyze_for_tpu` also estimate the program's time from the code libtpu generated
(:class:`torch_pallas.tpu_schedule.StepEstimate`)::

    >>> enable_estimates()  # before anything in the process initialises libtpu
    >>> print(compile_graph(outputs, "v5e", estimate=True).estimate.table(top=10))
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import importlib.util
import os
import re
import shutil
import tempfile
import time
from typing import Optional, Sequence

import jax

from torch_pallas import tpu_schedule
from torch_pallas.kernels import compat

# Each generation's smallest topology libtpu accepts ("v5e:1x1" is refused; TPU7x is
# "tpu7x", not "v7x"), oldest first. GENERATIONS keeps those the installed libtpu knows.
_TOPOLOGIES = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2", "tpu7x": "tpu7x:2x2x1"}


def available() -> bool:
    """Whether libtpu, the TPU compiler, is installed."""
    return importlib.util.find_spec("libtpu") is not None


# libtpu reads these once, when it initialises: its dump of each compile's final VLIW bundles
# and optimised HLO, which tpu_schedule reads.
_DUMP_FLAGS = ("--xla_jf_dump_llo_text=true", "--xla_jf_dump_llo_pass_label_regex=final_bundles")
_DUMP_TO = "--xla_jf_dump_to="
_libtpu = {"initialised": False, "dump_directory": None}
_captures: list = []


def enable_estimates() -> None:
    """Makes libtpu dump the code it generates for each compile, which time estimates read
    (``compile_graph(..., estimate=True)``, :func:`analyze_for_tpu`, :func:`compiler_dumps`).

    It adds ``--xla_jf_dump_to=DIR --xla_jf_dump_llo_text=true
    --xla_jf_dump_llo_pass_label_regex=final_bundles`` to ``LIBTPU_INIT_ARGS``, which libtpu reads
    once, when it initialises: call it before this module (or JAX, or torch_xla) first uses
    libtpu in the process. DIR is a private temporary directory removed at exit (or the one
    ``LIBTPU_INIT_ARGS`` already names), and each compile's files are deleted once read.
    Opt-in: dumping makes a large graph's compile about a quarter slower and writes tens of MB
    per compile (deleted once read). Calling it again does nothing.

    Raises:
        RuntimeError: this module already initialised libtpu without the dump.
    """
    if _libtpu["dump_directory"] is not None:
        return
    if _libtpu["initialised"]:
        raise RuntimeError("enable_estimates must be called before torch_pallas.tpu_compile first uses libtpu "
                           "(libtpu reads its dump flags when it initialises)")
    arguments = os.environ.get("LIBTPU_INIT_ARGS", "")
    named = re.search(re.escape(_DUMP_TO) + r"(\S+)", arguments)
    if named:
        directory = named.group(1)
    else:
        directory = tempfile.mkdtemp(prefix="torch_pallas_libtpu_dump_")
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
        arguments += f" {_DUMP_TO}{directory}"
    missing = [flag for flag in _DUMP_FLAGS if flag not in arguments]
    os.environ["LIBTPU_INIT_ARGS"] = " ".join([arguments.strip(), *missing])
    _libtpu["dump_directory"] = directory


@contextlib.contextmanager
def compiler_dumps():
    """Collects libtpu's dumps of what this module compiles inside the block.

    Yields a dict that holds ``{file name: text}`` once each compile returns: its final_bundles
    dumps (the top-level program, each fusion and each kernel) and its optimised HLO
    (``*-TLP-hlo.txt``), as :mod:`torch_pallas.tpu_schedule` reads them. Turns the dump on
    (:func:`enable_estimates`) if libtpu has not initialised yet.

    Raises:
        RuntimeError: libtpu runs without the dump (see :func:`enable_estimates`); or, at a
            compile, it wrote no dump: someone else (JAX, torch_xla) initialised it first.
    """
    enable_estimates()
    dumps: dict = {}
    _captures.append(dumps)
    try:
        yield dumps
    finally:
        _captures.remove(dumps)


@contextlib.contextmanager
def _reading_dumps():
    """Around one compile: hands the files libtpu dumped to the active compiler_dumps() blocks,
    then deletes them, so that the disk holds one compile's dumps at most."""
    directory = _libtpu["dump_directory"]
    if directory is None:
        yield
        return
    before = set(os.listdir(directory))
    yield
    dumped = {}
    for name in sorted(set(os.listdir(directory)) - before):
        path = os.path.join(directory, name)
        if _captures and (name.endswith("-TLP-hlo.txt") or name.endswith("final_bundles.txt")
                          and "schedule-analysis" not in name):
            with open(path) as file:
                dumped[name] = file.read()
        os.remove(path)
    if _captures and not any(name.endswith("-TLP-hlo.txt") for name in dumped):
        flags = " ".join([f"{_DUMP_TO}DIR", *_DUMP_FLAGS])
        raise RuntimeError(f"libtpu wrote no dump of this compile: it was initialised before "
                           f"torch_pallas.tpu_compile.enable_estimates() (by JAX or torch_xla?). "
                           f"Call that first, or set "
                           f"LIBTPU_INIT_ARGS='{flags}' before libtpu initialises")
    for dumps in _captures:
        dumps.update(dumped)


def _topology(name: str):
    from jax.experimental import topologies

    _libtpu["initialised"] = True
    return topologies.get_topology_desc(topology_name=name, platform="tpu")


# generation -> topology name: what _generations() found libtpu to know, once it knows any.
_known_generations: dict[str, str] = {}


def _generations() -> dict[str, str]:
    """Asks libtpu which generations it knows (libtpu 0.0.21: v4 to v6e; 0.0.52: TPU7x too).

    Raises:
        RuntimeError: libtpu refused for another reason than an unknown generation (another
            process holds its lockfile: one process at a time uses libtpu), with its message.
    """
    if not available():
        return {}
    if _known_generations:
        return _known_generations
    refusal = None
    for generation, topology in _TOPOLOGIES.items():
        try:
            _topology(topology)
        except Exception as error:
            if "Invalid TPU external name" not in str(error):  # what libtpu says of a generation it lacks
                refusal = refusal or error
            continue
        _known_generations[generation] = topology
    if not _known_generations and refusal is not None:
        raise RuntimeError(f"libtpu refused to describe any TPU topology: {refusal}") from refusal
    return _known_generations


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
    with compat.lowering_for_device(device), _reading_dumps():
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
    with compat.lowering_for_device(devices[0]), _reading_dumps():
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
    ``estimate`` is the program's time read off the code libtpu generated
    (:class:`torch_pallas.tpu_schedule.StepEstimate`) where one was asked for, else ``None``.
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
    estimate: Optional[tpu_schedule.StepEstimate] = None

    @property
    def flops(self) -> float:
        return self.cost.get("flops", 0.0)

    @property
    def bytes_accessed(self) -> float:
        return self.cost.get("bytes accessed", 0.0)


def _check_estimate(estimate) -> None:
    if not isinstance(estimate, bool):
        raise TypeError(f"estimate must be True or False, got {estimate!r}")


def _compiled(compile_program, generation: str, estimate: bool) -> GraphCompilation:
    """Runs ``compile_program()`` (it returns a loaded executable) and reads what libtpu reports."""
    with compiler_dumps() if estimate else contextlib.nullcontext() as dumps:
        start = time.perf_counter()
        executable = compile_program()
        seconds = time.perf_counter() - start
    memory = executable.get_compiled_memory_stats()
    cost = executable.cost_analysis()
    cost = dict(cost[0] if isinstance(cost, (list, tuple)) else cost)
    return GraphCompilation(
        generation=generation, seconds=seconds, peak_bytes=memory.peak_memory_in_bytes,
        argument_bytes=memory.argument_size_in_bytes, output_bytes=memory.output_size_in_bytes,
        temp_bytes=memory.temp_size_in_bytes, alias_bytes=memory.alias_size_in_bytes,
        generated_code_bytes=memory.generated_code_size_in_bytes, cost=cost,
        estimate=tpu_schedule.estimate(dumps, generation) if estimate else None)


def analyze_for_tpu(function, *args: jax.ShapeDtypeStruct, generation: str, estimate: bool = True) -> GraphCompilation:
    """Compiles ``function(*args)`` for one TPU of ``generation`` as :func:`compile_for_tpu` does
    and reports what libtpu's compiler says of it, its time estimate included.

    Args:
        function: a JAX function.
        args: the shapes and dtypes of its arguments.
        generation: a key of :data:`GENERATIONS`.
        estimate: whether to estimate its time (needs libtpu's dump: :func:`enable_estimates`,
            called here if libtpu has not initialised yet).

    Returns:
        :class:`GraphCompilation`: compile time, memory, cost analysis and ``estimate``.

    Raises:
        ValueError, jax.errors.JaxRuntimeError: as :func:`compile_for_tpu`.
        TypeError: ``estimate`` is not a bool.
        RuntimeError, NotImplementedError: as :func:`compiler_dumps` and
            :func:`torch_pallas.tpu_schedule.estimate` (a loop at top level; TPU7x).
    """
    _check_estimate(estimate)
    if estimate:
        enable_estimates()
    device = tpu_device(generation)
    sharding = jax.sharding.SingleDeviceSharding(device)
    on_tpu = [jax.ShapeDtypeStruct(arg.shape, arg.dtype, sharding=sharding) for arg in args]

    def compile_program():
        with compat.lowering_for_device(device), _reading_dumps():
            return jax.jit(function).lower(*on_tpu).compile().runtime_executable()
    return _compiled(compile_program, generation, estimate)


def compile_graph(tensors: Sequence, generation: str, *, estimate: bool = False,
                  dump_to: str | None = None) -> GraphCompilation:
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
        estimate: whether to estimate the graph's time (``GraphCompilation.estimate``; needs
            libtpu's dump: :func:`enable_estimates`, called here if libtpu has not initialised yet).
        dump_to: a directory for XLA's dumps of this compile (``debug_options.xla_dump_to``, as
            text): the HLO before and after optimisation and the buffer assignment
            (``*after_optimizations-buffer-assignment.txt``: each buffer's size, layout, offset
            and live range, what fills HBM at the peak).

    Returns:
        :class:`GraphCompilation`: compile time, memory and cost analysis (and ``estimate``).

    Raises:
        ValueError: an unknown ``generation``, or a tensor that is not an XLA tensor.
        TypeError: ``estimate`` is not a bool.
        RuntimeError: libtpu is not installed; or, with ``estimate``, it runs without its dump.
        NotImplementedError: torch_xla is in SPMD mode; or, with ``estimate``, as
            :func:`torch_pallas.tpu_schedule.estimate` (a loop at top level; TPU7x).
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
        raise RuntimeError("compile_graph needs libtpu, the TPU compiler: pip install libtpu==0.0.21 "
                           "(torch_pallas's test extra; 0.0.21, the version torch_xla[tpu] 2.9 pins)")
    if xr.is_spmd():
        raise NotImplementedError("compile_graph compiles unsharded graphs only; this process is in SPMD mode")
    _check_estimate(estimate)
    if estimate:
        enable_estimates()
    device = tpu_device(generation)
    proto = torch_xla._XLAC._get_xla_tensors_hlo_proto(tensors)
    # jax 0.7.1's private converter (the jax pin keeps it): libtpu's client takes StableHLO.
    module = xla_client._xla.mlir.hlo_to_stablehlo(proto)
    options = compiler.get_compile_options(num_replicas=1, num_partitions=1)
    if dump_to is not None:
        debug = options.executable_build_options.debug_options
        debug.xla_dump_to, debug.xla_dump_hlo_as_text = os.fspath(dump_to), True

    def compile_program():
        with _reading_dumps():
            return device.client.compile(module, xla_client.DeviceList((device,)), options)
    return _compiled(compile_program, generation, estimate)
