"""torch tensors in, a JAX function applied, torch tensors out: the one interface the ops call.

Each kind of tensor has its front end, a module of :mod:`torch_pallas.frontends` that is the
only place touching its library:

- ``xla``: torch_xla's lazy tensors (a kernel is one node of the lazy XLA graph);
- ``torchax``: torchax tensors (torch tensors holding a ``jax.Array``; the kernel is applied
  to the array, eagerly or inside a JAX trace);
- ``dlpack``: plain CPU tensors, handed to JAX on the CPU without a copy.

A front end is chosen by the tensor's device type and imported the first time a tensor of
its kind is seen, so neither torch_xla nor torchax is imported by a process that does not
use it. Each defines the functions this module and its callers forward to (``call``,
``draw_key_words``, ``default_device``, ``platform_is_tpu``, ``runs_lazily``, ``checkpoint``,
``check_use_reentrant``; for sharded tensors ``sharding_of``, ``sharding_from_mesh``,
``call_sharded``, ``sum_rows_in_order``); adding a front end means adding one module and
naming it in :data:`FRONT_ENDS`.

It also holds what is the same for every front end: whether Pallas kernels run compiled
(TPU) or in interpret mode, and the default noise generator.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os

import torch

# torch device type -> the front end's module (in torch_pallas.frontends)
FRONT_ENDS = {"xla": "xla", "jax": "torchax", "cpu": "dlpack"}

# The stack this process runs: torch_xla's when it is installed (its wheel also bundles an
# old torchax, which is not a front end here), else torchax's, else plain CPU tensors.
if importlib.util.find_spec("torch_xla") is not None:
    STACK = "xla"
elif importlib.util.find_spec("torchax") is not None:
    STACK = "torchax"
else:
    STACK = "dlpack"

_loaded: dict[str, object] = {}


def front_end(device_type: str):
    """The front-end module for tensors of ``device_type`` (imported on first use), or ``None``
    when torch_pallas has none for it on this stack."""
    module = _loaded.get(device_type)
    if module is None:
        name = FRONT_ENDS.get(device_type)
        if name is None or (name != "dlpack" and name != STACK):
            return None
        module = _loaded[device_type] = importlib.import_module(f"torch_pallas.frontends.{name}")
        for hook, args in _ANNOUNCEMENTS:
            _announce_to(module, hook, args)
    return module


# What the package has told the front ends, replayed to each one loaded later: (the name of
# the front end's function that takes it, its arguments). A front end without that function
# has no use for it.
_ANNOUNCEMENTS: list = []


def _announce_to(module, hook: str, args: tuple) -> None:
    function = getattr(module, hook, None)
    if function is not None:
        function(*args)


def _announce(hook: str, *args) -> None:
    _ANNOUNCEMENTS.append((hook, args))
    for module in set(_loaded.values()):
        _announce_to(module, hook, args)


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


def default_front_end():
    """The front end of this process's stack (:data:`STACK`)."""
    return front_end({"xla": "xla", "torchax": "jax", "dlpack": "cpu"}[STACK])


if STACK == "xla":
    # On TPU, torch_xla's PJRT client must own the chips before JAX initialises: the xla front
    # end is imported before anything imports JAX.
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
    torchax ``jax`` device, or the CPU."""
    return front_end(device.type) is not None


def runs_lazily(tensor: torch.Tensor) -> bool:
    """Whether ops on ``tensor`` (on a device torch_pallas runs on) are recorded to run later,
    so that one whose result nothing reads never runs: torch_xla's lazy tensors (not in its
    eager mode), torchax tensors inside a JAX trace; never CPU tensors."""
    return front_end(device_of(tensor).type).runs_lazily(tensor)


def device_or_default(device=None) -> torch.device:
    """The device to create tensors on: ``device`` if given (checked by :func:`runs_on`),
    else the default device of this process's stack (``torch_xla.device()``; ``jax`` with
    torchax; the CPU).

    Raises:
        ValueError: torch_pallas cannot run on ``device``.
    """
    if device is None:
        return default_front_end().default_device()
    device = torch.device(device)
    if not runs_on(device):
        raise ValueError(f"device must be {_DEVICES_HERE}, got {device}")
    return device


_DEVICES_HERE = {"xla": "an XLA device (torch_xla.device()) or the CPU",
                 "torchax": "a torchax device ('jax') or the CPU", "dlpack": "the CPU"}[STACK]
_MOVE_HINT = {"xla": "torch_xla.device()", "torchax": "'jax'", "dlpack": "'cpu'"}[STACK]


def check_device(tensor: torch.Tensor, name: str) -> None:
    """Raises ValueError unless torch_pallas runs on ``tensor``'s device (:func:`runs_on`),
    naming the fix."""
    device = device_of(tensor)
    if not runs_on(device):
        raise ValueError(f"{name} is on {device}, but torch_pallas ops run on {_DEVICES_HERE}: "
                         f"move it with {name}.to({_MOVE_HINT})")


def call(jax_function, *tensors: torch.Tensor, **static):
    """Applies ``jax_function(*tensors, interpret=..., **static)`` on the tensors' device,
    through the front end of the first tensor's device type; returns a tensor or a tuple.

    ``jax_function`` must be defined at module level: front ends cache its traced graph by
    the function, the tensors' shapes and dtypes, and the ``static`` values (each new static
    value traces and compiles anew, so pass only hashable configuration there).
    """
    return front_end(tensors[0].device.type).call(jax_function, tensors, static)


def torch_key_words(device=None, generator=None) -> torch.Tensor:
    """Two int32 words of key data drawn from torch's RNG: ``generator``'s, or ``device``'s
    (the XLA RNG on an XLA device, the default generator on the CPU)."""
    return torch.randint(-2**31, 2**31, (2,), dtype=torch.int32, generator=generator, device=device)


# The process-wide noise impl of calls without ``impl=``, as JAX's ``jax_default_prng_impl``:
# read from the environment once, changed by torch_pallas.random.set_default_impl.
NOISE_IMPL_VARIABLE = "TORCH_PALLAS_NOISE_IMPL"
# "threefry" on every platform, TPU included: it is bit for bit jax.random on every backend and
# tested so here, while the hardware PRNG's bits, though libtpu's schedule makes it the fast
# impl there (bench/results/tpu_cost.md), have never run on a TPU; it is opt-in until they have.
PLATFORM_NOISE_IMPL = "threefry"
_default_noise_impl = os.environ.get(NOISE_IMPL_VARIABLE) or PLATFORM_NOISE_IMPL


def default_noise_impl() -> str:
    """The noise impl of calls without ``impl=`` (unchecked: the environment may name any):
    the last :func:`set_default_noise_impl`, else ``$TORCH_PALLAS_NOISE_IMPL``, else
    :data:`PLATFORM_NOISE_IMPL`."""
    return _default_noise_impl


def set_default_noise_impl(impl: str | None) -> None:
    """Makes ``impl`` (checked by the caller) the default; ``None`` restores the environment's
    or the platform's. Dynamo guards on the value read: a change recompiles."""
    global _default_noise_impl
    _default_noise_impl = impl or os.environ.get(NOISE_IMPL_VARIABLE) or PLATFORM_NOISE_IMPL


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
