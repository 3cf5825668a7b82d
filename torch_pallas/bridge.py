"""torch tensors in, a JAX function applied, torch tensors out: the one interface the ops call.

Each kind of tensor has its front end, a module of :mod:`torch_pallas.frontends` that is the
only place touching its library:

- ``xla``: torch_xla's lazy tensors (a kernel is one node of the lazy XLA graph);
- ``torchax``: torchax tensors (torch tensors holding a ``jax.Array``; the kernel is applied
  to the array, eagerly or inside a JAX trace);
- ``torchtpu``: TorchTPU's ``tpu`` tensors (a kernel is a custom op TorchTPU's ``jax_op``
  makes, exported for TPU);
- ``dlpack``: plain CPU tensors, handed to JAX on the CPU without a copy.

A front end is chosen by the tensor's device type and imported the first time a tensor of
its kind is seen, so neither torch_xla nor torchax is imported by a process that does not
use it. What a front end provides is stated once, by :class:`FrontEnd` (every front end)
and :class:`ShardingFrontEnd` (front ends whose tensors can be sharded over a mesh); a
front-end module names the protocols it implements in ``IMPLEMENTS`` and is checked
against them when it is loaded (:func:`check_front_end`). Adding a front end means adding
one module and naming it in :data:`FRONT_ENDS`. The rest of the package reaches a front end
through this module's functions only.

An installed stack whose library does not import (torch_xla 2.9 beside another torch than
2.9.0, say) leaves the process on plain CPU tensors, with a warning naming the fix
(:func:`_stack_imports`).

It also holds what is the same for every front end: whether Pallas kernels run compiled
(TPU) or in interpret mode, and the default noise generator.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import sys
import warnings
from typing import TYPE_CHECKING, Callable, Optional, Protocol, Sequence

import torch

if TYPE_CHECKING:
    from torch_pallas.sharding import Sharding

# torch device type -> the front end's module (in torch_pallas.frontends)
FRONT_ENDS = {"xla": "xla", "jax": "torchax", "tpu": "torchtpu", "cpu": "dlpack"}


def _installed(package: str) -> bool:
    """Whether ``package`` is installed: a namespace package of the same name (a folder on the
    path, such as the test suite's ``tests/torchax``) is not."""
    spec = importlib.util.find_spec(package)
    return spec is not None and spec.origin is not None


# Each accelerator stack's library, and the torch it imports beside (what its extra pins).
_LIBRARIES = {"xla": "torch_xla", "torchax": "torchax", "torchtpu": "torch_tpu"}
_FIXES = {
    "xla": "torch_xla 2.9 needs torch 2.9.0: pip install torch==2.9.0 (torch_pallas's xla extra pins it)",
    "torchax": "torchax 0.0.13 runs on torch 2.12 and no newer: pip install 'torch>=2.12,<2.13' "
               "(torch_pallas's torchax extra pins it)",
    "torchtpu": "torch_tpu 0.2.0 runs on torch 2.11 to 2.15: pip install 'torch>=2.11,<=2.15' "
                "(torch_pallas's torchtpu extra pins it)",
}

# The stack this process runs: torch_xla's when it is installed (its wheel also bundles an
# old torchax, which is not a front end here), else torchax's, else TorchTPU's, else plain
# CPU tensors. (torchax imports on torch <= 2.12 and TorchTPU needs torch >= 2.11: an
# environment with both runs torchax's.) Plain CPU tensors too when the stack's library is
# installed but does not import (:func:`_stack_imports`, at its front end's first use).
STACK = next((stack for stack, library in _LIBRARIES.items() if _installed(library)), "dlpack")


class FrontEnd(Protocol):
    """What every front end provides: the members of its module (``def name(...)`` without
    ``self``; a module is the implementation). :func:`check_front_end` holds a module to it."""

    # How error messages name the device and what ``.to(...)`` takes to move a tensor there.
    DEVICE_DESCRIPTION: str
    MOVE_HINT: str
    # The device types a call's ``generator=`` may be on (the CPU, and the stack's device where
    # torch makes generators for it), how error messages name them, and what seeds the device's
    # own RNG (a call without seed or generator).
    GENERATOR_DEVICE_TYPES: tuple
    GENERATORS: str
    SEEDED_BY: str
    # The stack's own reentrant checkpoint Functions besides torch's (torch_xla's), whose
    # recomputation torch_pallas routes as torch's (torch_pallas.checkpointing).
    CHECKPOINT_FUNCTIONS: tuple

    def platform_is_tpu(self) -> bool:
        """Whether this process's accelerator is a TPU (read once: :func:`on_tpu`)."""

    def default_device(self) -> torch.device:
        """Where tensors are created when a call names no device (:func:`device_or_default`)."""

    def check_device_usable(self, device: torch.device) -> None:
        """Raises ``RuntimeError`` naming the fix when tensors cannot be created on ``device``
        now (torchax: outside its environment); returns otherwise."""

    def runs_lazily(self, tensor: torch.Tensor) -> bool:
        """Whether ops on ``tensor`` are recorded to run later (:func:`runs_lazily`)."""

    def draw_key_words(self, device: torch.device) -> torch.Tensor:
        """Two int32 words of key data from ``device``'s own RNG (a call without seed or
        generator)."""

    def call(self, jax_function, tensors: Sequence[torch.Tensor], static: dict):
        """``jax_function(*arrays, **static, interpret=...)`` on the tensors' arrays: a tensor
        or a tuple of them (:func:`call`)."""

    def check_use_reentrant(self, use_reentrant) -> None:
        """Raises ``ValueError`` for a ``use_reentrant`` this stack's checkpoint cannot take."""

    def checkpoint(self, region, *args, use_reentrant, preserve_rng_state):
        """``region(*args)`` under the stack's activation checkpointing."""

    def register_op(self, op, compute, formula) -> None:
        """Told of every custom op (:func:`register_op`); a front end whose tensors go through
        torch's dispatcher has nothing to do."""

    def defer_function_to_mode(self, func, mode_type) -> None:
        """Told of every torch function a mode must see first (:func:`defer_function_to_mode`);
        a front end that takes no torch function itself has nothing to do."""


class ShardingFrontEnd(FrontEnd, Protocol):
    """What a front end whose tensors can be sharded over a mesh provides besides
    :class:`FrontEnd` (:mod:`torch_pallas.sharding` says what a sharding is)."""

    MESH_TYPE_NAME: str  # the mesh type a call's ``mesh=`` must be, as error messages name it

    def is_mesh(self, mesh) -> bool:
        """Whether ``mesh`` is this stack's mesh type."""

    def sharding_of(self, tensor: torch.Tensor) -> Optional["Sharding"]:
        """The sharding ``tensor`` carries (``None``: on one device, or replicated)."""

    def sharding_from_mesh(self, mesh, partition_spec: Sequence) -> Optional["Sharding"]:
        """The sharding ``mesh`` and ``partition_spec`` give a tensor."""

    def call_sharded(self, jax_function, sharding_text: str, tensors, in_dims, out_dims, noise_shape,
                     static: dict):
        """:func:`call_sharded` on this stack's tensors."""

    def sum_rows_in_order(self, rows: torch.Tensor, sharding_text: str, dims: tuple,
                          like: torch.Tensor) -> torch.Tensor:
        """:func:`sum_rows_in_order` on this stack's tensors."""


class GraphCompilingFrontEnd(FrontEnd, Protocol):
    """A front end whose stack compiles torch graphs itself (torch_xla: ``"openxla"``)."""

    def compile_aot_graph(self, graph_module: torch.fx.GraphModule, example_inputs) -> Callable:
        """An AOTAutograd graph compiled as the stack's ``torch.compile`` backend compiles it."""


# Every protocol a front end may name in IMPLEMENTS, FrontEnd first.
PROTOCOLS = (FrontEnd, ShardingFrontEnd, GraphCompilingFrontEnd)


def members_of(protocol) -> dict[str, Optional[inspect.Signature]]:
    """The members one of :data:`PROTOCOLS` declares itself: name -> signature without
    ``self`` (``None`` for a constant)."""
    members = {name: None for name in protocol.__dict__.get("__annotations__", {})}
    for name, value in vars(protocol).items():
        if inspect.isfunction(value) and not name.startswith("_"):
            signature = inspect.signature(value)
            members[name] = signature.replace(parameters=list(signature.parameters.values())[1:])
    return members


def check_front_end(module) -> None:
    """Checks that ``module`` declares the protocols it implements (``IMPLEMENTS``, with
    :class:`FrontEnd` among them) and has each of their members, functions with the protocol's
    parameters.

    Raises:
        TypeError: naming the module and every member that is missing or differs.
    """
    implements = getattr(module, "IMPLEMENTS", ())
    problems = [] if FrontEnd in implements else ["IMPLEMENTS does not name bridge.FrontEnd"]
    # each protocol with those it extends, once
    protocols = [protocol for protocol in PROTOCOLS if any(protocol in named.__mro__ for named in implements)]
    for protocol in protocols:
        for name, signature in members_of(protocol).items():
            value = getattr(module, name, None)
            if value is None:
                problems.append(f"{name} ({protocol.__name__}) is missing")
            elif signature is not None and (not callable(value) or _parameters(value) != _parameters(signature)):
                problems.append(f"{name} must take {signature}")
    if problems:
        raise TypeError(f"front end {module.__name__}: " + "; ".join(problems))


def _parameters(function_or_signature) -> list[tuple[str, object]]:
    signature = (function_or_signature if isinstance(function_or_signature, inspect.Signature)
                 else inspect.signature(function_or_signature))
    return [(parameter.name, parameter.kind) for parameter in signature.parameters.values()]


_loaded: dict[str, FrontEnd] = {}


def front_end(device_type: str) -> Optional[FrontEnd]:
    """The front end for tensors of ``device_type`` (imported and checked on first use), or
    ``None`` when torch_pallas has none for it on this stack."""
    module = _loaded.get(device_type)
    if module is None:
        name = FRONT_ENDS.get(device_type)
        if name is None or (name != "dlpack" and (name != STACK or not _stack_imports())):
            return None
        module = importlib.import_module(f"torch_pallas.frontends.{name}")
        check_front_end(module)
        _loaded[device_type] = module
        for hook, args in _ANNOUNCEMENTS:
            getattr(module, hook)(*args)
    return module


# What the package has told the front ends, replayed to each one loaded later: (the name of
# the FrontEnd member that takes it, its arguments).
_ANNOUNCEMENTS: list = []


def _announce(hook: str, *args) -> None:
    _ANNOUNCEMENTS.append((hook, args))
    for module in set(_loaded.values()):
        getattr(module, hook)(*args)


def register_op(op, compute, formula=None) -> None:
    """Tells every front end, loaded now or later, how to run the custom ``op``:
    ``compute(*args)`` is its computation on torch tensors and ``formula`` its
    ``(setup_context, backward)``, as registered with torch's autograd (``None`` for an op
    nothing differentiates). torchax runs a custom op through its own dispatch, which must be
    told how."""
    _announce("register_op", op, compute, formula)


def defer_function_to_mode(func, mode_type) -> None:
    """Tells every front end, loaded now or later, that a call of the torch function ``func``
    goes to the innermost active ``mode_type`` (a ``TorchFunctionMode``) when one is active,
    even if the front end's own function mode (torchax's, entered later, so above it on
    torch's mode stack) would take it first; what the mode hands back to ``func`` runs the
    front end's own rule."""
    _announce("defer_function_to_mode", func, mode_type)


def _stack_imports() -> bool:
    """Whether this process's stack's library imports (imported now, before its front end).
    If it does not (torch_xla 2.9 beside another torch than 2.9.0: its C++ extension fails to
    load), warns with the error and the fix, and makes this process's stack plain CPU tensors
    (``"dlpack"``): CPU tensors keep working, the stack's own tensors are not taken."""
    global STACK, _STACK_DEVICE_TYPE
    library = _LIBRARIES[STACK]
    try:
        importlib.import_module(library)
    except Exception as error:  # ImportError, OSError; torchax on torch 2.13: AttributeError
        try:
            version = f" {importlib.metadata.version(library.replace('_', '-'))}"
        except importlib.metadata.PackageNotFoundError:
            version = ""
        reason = (str(error).splitlines() or [""])[0]
        warnings.warn(
            f"torch_pallas: {library}{version} is installed but cannot be imported beside torch "
            f"{torch.__version__} ({type(error).__name__}: {reason}); {_FIXES[STACK]}. Until then "
            f"torch_pallas runs on CPU tensors only in this process", UserWarning, stacklevel=2)
        STACK, _STACK_DEVICE_TYPE = "dlpack", "cpu"
        return False
    return True


def default_front_end() -> FrontEnd:
    """The front end of this process's stack (:data:`STACK`); the CPU's when the stack's
    library turns out not to import (:func:`_stack_imports`)."""
    front = front_end(_STACK_DEVICE_TYPE)
    return front if front is not None else front_end("cpu")


_STACK_DEVICE_TYPE = next(device_type for device_type, name in FRONT_ENDS.items() if name == STACK)


if STACK == "xla":
    # On TPU, torch_xla's PJRT client must own the chips before JAX initialises: the xla front
    # end is imported before anything imports JAX.
    default_front_end()
elif STACK == "torchtpu":
    # Loaded now, not at the first tpu tensor: that may come while dynamo traces, which cannot
    # trace an import. It keeps JAX off the TPU TorchTPU owns; torch_tpu itself is imported by
    # torch (a device backend it loads at ``import torch``).
    default_front_end()


@torch.compiler.assume_constant_result  # fixed for a process; dynamo cannot trace into the clients
@functools.cache
def on_tpu() -> bool:
    """Whether this process's accelerator is a TPU (``PJRT_DEVICE=TPU`` with torch_xla; JAX's
    default backend with torchax)."""
    return default_front_end().platform_is_tpu()


def device_of(tensor: torch.Tensor) -> torch.device:
    """``tensor``'s device; for a tensor ``torch.func`` wraps, the device of the tensor inside
    (a wrapper reports the C++ device of what it wraps: a torchax tensor's is ``meta``).
    Dynamo cannot trace functorch's bindings, and traces no wrapped tensor."""
    if torch.compiler.is_compiling():
        return tensor.device
    while torch._C._functorch.is_functorch_wrapped_tensor(tensor):
        tensor = torch._C._functorch.get_unwrapped(tensor)
    return tensor.device


def runs_on(device: torch.device) -> bool:
    """Whether torch_pallas's ops run on tensors of ``device``: an XLA device (torch_xla), a
    torchax ``jax`` device, TorchTPU's ``tpu`` device, or the CPU."""
    return front_end(device.type) is not None


def runs_lazily(tensor: torch.Tensor) -> bool:
    """Whether ops on ``tensor`` (on a device torch_pallas runs on) are recorded to run later,
    so that one whose result nothing reads never runs: torch_xla's lazy tensors (not in its
    eager mode), torchax tensors inside a JAX trace; never CPU tensors, nor tensors of a
    device torch_pallas does not run on (``meta``, CUDA)."""
    front = front_end(device_of(tensor).type)
    return front is not None and front.runs_lazily(tensor)


def device_or_default(device=None) -> torch.device:
    """The device to create tensors on: ``device`` if given (checked by :func:`runs_on`; or
    ``meta``),
    else the default device of this process's stack (``torch_xla.device()``; ``jax`` with
    torchax; ``tpu`` with TorchTPU; the CPU).

    Raises:
        ValueError: torch_pallas cannot run on ``device``.
        RuntimeError: no tensor can be created on it now (torchax's ``jax`` device outside
            torchax's environment), naming how to enter it.
    """
    if device is None:
        front = default_front_end()
        device = front.default_device()
    else:
        device = torch.device(device)
        if device.type == "meta":
            return device  # shapes only (check_device)
        front = front_end(device.type)
        if front is None:
            raise ValueError(f"device must be {_devices_here()}, got {device}")
    front.check_device_usable(device)
    return device


def _devices_here() -> str:
    """The devices torch_pallas runs on in this process, as error messages name them."""
    front = default_front_end()
    return front.DEVICE_DESCRIPTION if front is front_end("cpu") else f"{front.DEVICE_DESCRIPTION} or the CPU"


def check_generator_device(generator: torch.Generator) -> None:
    """Raises ``ValueError`` unless ``generator`` is on one of the stack's
    :attr:`FrontEnd.GENERATOR_DEVICE_TYPES`."""
    front = default_front_end()
    if generator.device.type not in front.GENERATOR_DEVICE_TYPES:
        raise ValueError(f"generator must be {front.GENERATORS} (got one on {generator.device}); "
                         f"to follow {front.SEEDED_BY} instead, pass neither seed nor generator")


def is_dtensor(tensor) -> bool:
    """Whether ``tensor`` is a ``torch.distributed.tensor.DTensor`` (:mod:`torch_pallas.dtensors`)."""
    dtensor = sys.modules.get("torch.distributed.tensor")  # none exists before it is imported
    return dtensor is not None and isinstance(tensor, dtensor.DTensor)


def check_device(tensor: torch.Tensor, name: str, *, dtensors: bool = False) -> None:
    """Raises unless torch_pallas runs on ``tensor``'s device (:func:`runs_on`) now, naming the
    fix: ``ValueError`` for a device it has no front end for, ``RuntimeError`` for one it
    cannot run on at this point (torchax's ``jax`` device outside torchax's environment),
    ``TypeError`` for a DTensor where the op takes none (``dtensors`` false)."""
    if is_dtensor(tensor) and not dtensors:
        raise TypeError(
            f"{name} is a DTensor, which this torch_pallas op does not take yet (dropout, its channel variants, "
            f"dropout_add, dropout_linear, dropout_matmul, attention, indrnn, sample_tokens and random.* with "
            f"device_mesh= do, "
            f"each shard drawing its part of the whole tensor's noise): pass {name}.full_tensor() "
            f"for the whole tensor, or {name}.to_local() with a seed of each rank's own for per-shard noise "
            f"(docs/sharding.md)")
    device = device_of(tensor)
    if device.type == "meta":
        return  # shapes only, as torch's ops on meta tensors: each op's fake function gives its outputs
    front = front_end(device.type)
    if front is None:
        raise ValueError(f"{name} is on {device}, but torch_pallas ops run on {_devices_here()}: "
                         f"move it with {name}.to({default_front_end().MOVE_HINT})")
    front.check_device_usable(device)


def call(jax_function, *tensors: torch.Tensor, **static):
    """Applies ``jax_function(*tensors, interpret=..., **static)`` on the tensors' device,
    through the front end of the first tensor's device type; returns a tensor or a tuple.

    ``jax_function`` must be defined at module level: front ends cache its traced graph by
    the function, the tensors' shapes and dtypes, and the ``static`` values (each new static
    value traces and compiles anew, so pass only hashable configuration there).

    Raises:
        TypeError: a DTensor among ``tensors`` (a kernel takes a rank's local tensors: an op
            of DTensors runs through :mod:`torch_pallas.dtensors`; a DTensor handed to a
            front end crashed the process, a segfault, on torch 2.14, 2026-12-04).
    """
    dtensor = next((i for i, tensor in enumerate(tensors) if is_dtensor(tensor)), None)
    if dtensor is not None:
        raise TypeError(f"argument {dtensor} of {getattr(jax_function, '__name__', jax_function)} is a DTensor; "
                        f"kernels take each rank's local tensor (DTensor.to_local())")
    return front_end(tensors[0].device.type).call(jax_function, tensors, static)


def torch_key_words(device=None, generator=None) -> torch.Tensor:
    """Two int32 words of key data drawn from torch's RNG: ``generator``'s (on its device), or
    ``device``'s (the XLA RNG on an XLA device, the default generator on the CPU)."""
    if generator is not None:
        device = generator.device
    return torch.randint(-2**31, 2**31, (2,), dtype=torch.int32, generator=generator, device=device)


# The noise impl chosen for the whole process, as JAX's ``jax_default_prng_impl``: read from the
# environment once, changed by torch_pallas.random.set_default_impl; ``None`` leaves each kind of
# op its own default (prng.DROPOUT_DEFAULT, prng.SAMPLING_DEFAULT).
NOISE_IMPL_VARIABLE = "TORCH_PALLAS_NOISE_IMPL"
_chosen_noise_impl = os.environ.get(NOISE_IMPL_VARIABLE) or None


def chosen_noise_impl() -> str | None:
    """The noise impl of every call without ``impl=`` (unchecked: the environment may name
    any): the last :func:`choose_noise_impl`, else ``$TORCH_PALLAS_NOISE_IMPL``, else ``None``."""
    return _chosen_noise_impl


def choose_noise_impl(impl: str | None) -> None:
    """Makes ``impl`` (checked by the caller) the impl of every call without one; ``None``
    restores the environment's choice, or none. Dynamo guards on the value read: a change
    recompiles."""
    global _chosen_noise_impl
    _chosen_noise_impl = impl or os.environ.get(NOISE_IMPL_VARIABLE) or None


LOWER_FOR_TPU_VARIABLE = "TORCH_PALLAS_LOWER_FOR_TPU"


def _lowering_for_tpu_in(environment) -> bool:
    """Whether ``environment`` turns TPU lowering on: ``TORCH_PALLAS_LOWER_FOR_TPU`` set to
    anything but ``""`` or ``"0"``."""
    return environment.get(LOWER_FOR_TPU_VARIABLE, "0") not in ("", "0")


# Process-wide, not per thread: autograd runs the backward pass on a thread of its own, and
# its kernels must be lowered as the forward's are.
_lowering_for_tpu = _lowering_for_tpu_in(os.environ)


def lowers_for_tpu() -> bool:
    """Whether kernels on accelerator tensors (XLA, torchax) are lowered for TPU (Mosaic), not
    run in interpret mode: always on a TPU; elsewhere under :func:`lowering_for_tpu` or
    ``TORCH_PALLAS_LOWER_FOR_TPU=1``."""
    return _lowering_for_tpu or on_tpu()


def compiles_for_tpu(tensor: torch.Tensor) -> bool:
    """Whether kernels applied to ``tensor`` are compiled for a TPU (Mosaic) rather than run in
    interpret mode: always on TorchTPU's ``tpu`` tensors, under :func:`lowers_for_tpu` on XLA
    and torchax tensors, never on CPU tensors (what each front end's ``call`` does)."""
    front = FRONT_ENDS.get(tensor.device.type)
    return front == "torchtpu" or (front in ("xla", "torchax") and lowers_for_tpu())


def interpret_mode() -> bool:
    """Whether kernels on accelerator tensors run in Pallas's interpret mode (the opposite of
    :func:`lowers_for_tpu`). CPU tensors always do."""
    return not lowers_for_tpu()


@contextlib.contextmanager
def lowering_for_tpu(enabled: bool = True):
    """Inside this context, kernels applied to XLA or torchax tensors are lowered for TPU
    (Pallas compiled to Mosaic, not interpret mode) on every device, so the graph holds the
    same TPU custom calls as on a TPU. Off by default; ``TORCH_PALLAS_LOWER_FOR_TPU=1`` in
    the environment turns it on for the whole process.

    Off a TPU such a graph is for :func:`torch_pallas.tpu_compile.compile_graph` (or a JAX
    function's ``lower(...).compile()`` on a compile-only TPU device) only: the CPU cannot
    run a TPU custom call. Process-wide while active (the backward pass runs on another
    thread). CPU tensors still run in interpret mode.

    Example::

        >>> with torch_pallas.tpu_compile.lowering_for_tpu():
        ...     loss = model(x).loss
        ...     loss.backward()
        >>> torch_pallas.tpu_compile.compile_graph([loss, *grads], "v5e").peak_bytes
    """
    global _lowering_for_tpu
    previous, _lowering_for_tpu = _lowering_for_tpu, enabled
    try:
        yield
    finally:
        _lowering_for_tpu = previous


@functools.cache
def jitted(jax_function, static: tuple, interpret: bool):
    """``jax.jit`` of ``jax_function`` with its static keyword arguments (``static``: sorted
    ``(name, value)`` pairs) and ``interpret`` bound: the form the JAX-array front ends apply,
    cached by all three."""
    import jax

    return jax.jit(functools.partial(jax_function, **dict(static), interpret=interpret))


def draw_key_words(device: torch.device) -> torch.Tensor:
    """Two int32 words of key data from the RNG of ``device`` (one torch_pallas runs on); on
    the meta device, which holds no values, two words of none, as torch's RNG ops there."""
    if device.type == "meta":
        return torch.empty(2, dtype=torch.int32, device=device)
    return front_end(device.type).draw_key_words(device)


def sharding_of(tensor: torch.Tensor) -> Optional["Sharding"]:
    """The sharding ``tensor`` carries (:meth:`ShardingFrontEnd.sharding_of`); ``None`` for a
    tensor on one device, a replicated one, or one whose front end has no meshes."""
    front = front_end(tensor.device.type)
    if front is None or ShardingFrontEnd not in front.IMPLEMENTS:
        return None
    return front.sharding_of(tensor)


def sharding_from_mesh(mesh, partition_spec: Sequence) -> Optional["Sharding"]:
    """The sharding ``mesh`` (this stack's mesh type) and ``partition_spec`` give a tensor.

    Raises:
        TypeError: ``mesh`` is not this stack's mesh type (the CPU-only stack has none).
    """
    front = default_front_end()
    if ShardingFrontEnd not in front.IMPLEMENTS:
        raise TypeError(f"mesh must be a mesh of an accelerator stack, got {type(mesh).__name__}")
    if not front.is_mesh(mesh):
        raise TypeError(f"mesh must be a {front.MESH_TYPE_NAME}, got {type(mesh).__name__}")
    return front.sharding_from_mesh(mesh, partition_spec)


def call_sharded(jax_function, sharding_text: str, tensors: Sequence[torch.Tensor], in_dims: Sequence[tuple],
                 out_dims: Sequence[tuple], *, noise_shape: Optional[Sequence[int]] = None, **static):
    """``jax_function`` applied to each device's shards of ``tensors`` (sharded as
    ``sharding_text``, a :class:`~torch_pallas.sharding.Sharding`'s text, says); returns the
    outputs put back together, sharded as ``out_dims`` say, with no all-gather.

    ``in_dims[i][k]`` is the dim of the sharding that dim ``k`` of ``tensors[i]`` follows,
    or ``None`` for a dim every device holds whole (likewise ``out_dims`` for the outputs).
    With ``noise_shape`` the function is a noise kernel whose first argument is key data
    (replicated): it gets ``global_shape=noise_shape`` and, as data, its shard's offset in
    that shape (``shared_over_first_dim`` in ``static``: in ``noise_shape[1:]``).
    """
    return front_end(tensors[0].device.type).call_sharded(
        jax_function, sharding_text, tensors, in_dims, out_dims, noise_shape, static)


def sum_rows_in_order(rows: torch.Tensor, sharding_text: str, dims: tuple, like: torch.Tensor) -> torch.Tensor:
    """The sum over dim 0 of ``rows``, split as ``dims`` say, in a fixed order, sharded as
    ``like`` (a parameter whose gradient this is: replicated unless it is sharded).

    The rows are first gathered onto every device (an all-gather of this small tensor only)
    and summed there, so the result does not depend on a cross-device reduction's order."""
    return front_end(rows.device.type).sum_rows_in_order(rows, sharding_text, dims, like)


def check_use_reentrant(use_reentrant) -> None:
    """Raises ``ValueError`` for a ``use_reentrant`` this stack's checkpoint cannot take."""
    default_front_end().check_use_reentrant(use_reentrant)


def checkpoint(device: torch.device, region, *args, use_reentrant, preserve_rng_state):
    """``region(*args)`` under the activation checkpointing of ``device``'s stack."""
    return front_end(device.type).checkpoint(region, *args, use_reentrant=use_reentrant,
                                             preserve_rng_state=preserve_rng_state)


def graph_compiler() -> Optional[GraphCompilingFrontEnd]:
    """This stack's front end if it compiles torch graphs itself (torch_xla's), else ``None``."""
    front = default_front_end()
    return front if GraphCompilingFrontEnd in front.IMPLEMENTS else None
