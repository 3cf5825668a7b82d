"""The torchax front end: torchax tensors (torch tensors holding a ``jax.Array``, device
``jax``), on the newest torch and JAX.

The only module that touches torchax. A kernel is applied to the tensors' arrays: jitted
in eager mode, inlined into the trace inside ``torchax.compile`` / ``jax.jit``. torchax runs
every op on its tensors through its own dispatch, so each torch_pallas custom op is
registered there (:func:`register_op`) with its computation, wrapped in a ``jax.custom_vjp``
made from the op's autograd formula: torch's autograd on torchax tensors and JAX's
(``jax.grad`` over a torch function, as torchax's training helpers build a step) both
reach the same backward kernels. Sharded arrays run their kernels per shard under
``jax.shard_map`` (:func:`call_sharded`).
"""

from __future__ import annotations

import functools
import threading
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.utils._python_dispatch
import torchax
from torchax import tensor as torchax_tensor

from torch_pallas import bridge
# Checkpointing on torchax tensors is torch's own, as on CPU tensors.
from torch_pallas.frontends.dlpack import check_use_reentrant, checkpoint  # noqa: F401
from torch_pallas.sharding import Sharding, with_shard_offset

IMPLEMENTS = (bridge.FrontEnd, bridge.ShardingFrontEnd)
DEVICE_DESCRIPTION = "a torchax device ('jax')"
MOVE_HINT = "'jax'"
# torchax's jax device has no torch.Generator; its RNG is torchax's own.
GENERATOR_DEVICE_TYPES = ("cpu",)
GENERATORS = "a CPU torch.Generator"
SEEDED_BY = "torchax.default_env().manual_seed"
CHECKPOINT_FUNCTIONS = ()
MESH_TYPE_NAME = "jax.sharding.Mesh"


def platform_is_tpu() -> bool:
    """Whether JAX's default backend is a TPU."""
    return jax.default_backend() == "tpu"


def default_device() -> torch.device:
    return torch.device("jax")


_TORCHAX_TENSORS = (torchax_tensor.Tensor, torchax_tensor.View)
_TORCHAX_MODES = (torchax_tensor.XLAFunctionMode, torchax_tensor.XLADispatchMode)


def _environment_entered() -> bool:
    """Whether torchax's environment is active: entered (``with env:``, ``enable_globally()``),
    or its modes on torch's stacks (``env.enabled`` alone reads False after a nested ``with
    env:`` has exited inside an outer one)."""
    if torchax.default_env().enabled:
        return True
    modes = (*torch.overrides._get_current_function_mode_stack(),
             *torch.utils._python_dispatch._get_current_dispatch_mode_stack())
    return any(isinstance(mode, _TORCHAX_MODES) for mode in modes)


def check_device_usable(device: torch.device) -> None:
    """Raises RuntimeError outside torchax's environment for the ``jax`` device, where torch
    itself would fail ("PyTorch is not linked with support for jax devices") or torchax
    would refuse to compute."""
    if device.type == "jax" and not _environment_entered():
        raise RuntimeError(
            "torchax tensors (device 'jax') are made and computed inside torchax's environment: run this call "
            "inside `with torchax.default_env():` or call torchax.enable_globally() first")


def runs_lazily(tensor: torch.Tensor) -> bool:
    """Inside a JAX trace (jax.jit, torchax.compile): the tensor holds a tracer; eager torchax
    tensors run each op when it is called."""
    return isinstance(tensor, _TORCHAX_TENSORS) and isinstance(_array(tensor), jax.core.Tracer)


def _environment(tensors) -> torchax_tensor.Environment:
    for tensor in tensors:
        if isinstance(tensor, _TORCHAX_TENSORS):
            return tensor._env
    return torchax.default_env()


def _array(tensor) -> jax.Array:
    if isinstance(tensor, torchax_tensor.Tensor):
        return tensor._elem
    if isinstance(tensor, torchax_tensor.View):
        return tensor.jax()
    raise TypeError(f"expected a torchax tensor, got {type(tensor).__name__} on {tensor.device}")


def _wrap(outputs, env):
    if isinstance(outputs, (tuple, list)):
        return tuple(torchax_tensor.Tensor(output, env) for output in outputs)
    return torchax_tensor.Tensor(outputs, env)


def call(jax_function, tensors, static: dict):
    """``jax_function(*arrays, **static)`` on the tensors' arrays (jitted; inside a JAX trace,
    part of it), the outputs as torchax tensors."""
    interpret = not bridge.lowers_for_tpu()
    jitted = bridge.jitted(jax_function, tuple(sorted(static.items())), interpret)
    return _wrap(jitted(*[_array(tensor) for tensor in tensors]), _environment(tensors))


def draw_key_words(device: torch.device) -> torch.Tensor:
    """Two int32 words of a key from torchax's own RNG, as its dropout draws keys (seeded
    from ``torch.initial_seed()`` when the environment starts, or by ``env.manual_seed``;
    inside a JAX trace, from a key the traced function was given through
    ``env.override_property(prng=key)``).

    Raises:
        RuntimeError: inside a JAX trace whose environment holds a constant key (every run of
            the compiled function would draw the same noise), or when torchax's RNG holds a
            tracer an earlier trace left there.
    """
    env = torchax.default_env()
    before = env.param.prng
    try:
        key = env.get_and_rotate_prng_key()
    except jax.errors.UnexpectedTracerError as error:
        raise RuntimeError(
            "torchax's RNG holds a tracer left by a random op of torchax's own (its dropout, say) that ran "
            "inside an earlier jax.jit without a key input; reseed it with torchax.default_env().manual_seed(s), "
            "and give such functions their keys (env.override_property(prng=key))") from error
    if isinstance(key, jax.core.Tracer) and not isinstance(before, jax.core.Tracer):
        env.param.prng = before  # a tracer left there would break every later draw
        raise RuntimeError(
            "torch_pallas draws a key inside a JAX trace (torchax.compile, jax.jit) from torchax's RNG, which "
            "holds a constant there: every call of the compiled function would get the same noise. Give the "
            "function its keys as an input: call it with key=torch_pallas.seeds.key_data() and run the model "
            "inside `with torch_pallas.seeds.key_scope(key):` (or `with env.override_property(prng=jax_key):`), "
            "or pass seed= to each random op")
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return torchax_tensor.Tensor(jax.lax.bitcast_convert_type(key.astype(jnp.uint32), jnp.int32), env)


class _Context:
    """What an op's ``setup_context`` and ``backward`` use of torch's ``ctx``."""

    def __init__(self, inputs):
        self.needs_input_grad = tuple(isinstance(value, torch.Tensor) and value.is_floating_point()
                                      for value in inputs)
        self.saved_tensors = ()

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def save_for_forward(self, *tensors):
        pass


def _run_differentiable(compute, formula, env, args):
    """``compute(*args)`` as a ``jax.custom_vjp`` of its tensor arguments' arrays whose backward
    is the op's torch formula run on torchax tensors: so ``jax.grad`` and ``jax.vjp`` over a
    torch function reach the backward kernels (JAX cannot differentiate a Pallas kernel
    itself). Without a JAX transformation it is ``compute(*args)``."""
    setup_context, backward = formula
    places = [index for index, value in enumerate(args) if isinstance(value, torch.Tensor)]

    def arguments(arrays):
        full = list(args)
        for index, array in zip(places, arrays):
            full[index] = torchax_tensor.Tensor(array, env)
        return tuple(full)

    def arrays_of(outputs):
        return tuple(map(_array, outputs)) if isinstance(outputs, (tuple, list)) else _array(outputs)

    contexts = []

    @jax.custom_vjp
    def differentiable(*arrays):
        return arrays_of(compute(*arguments(arrays)))

    def forward(*arrays):
        inputs = arguments(arrays)
        outputs = compute(*inputs)
        ctx = _Context(inputs)
        setup_context(ctx, inputs, outputs)
        contexts.append(ctx)
        saved = tuple(None if tensor is None else _array(tensor) for tensor in ctx.saved_tensors)
        return arrays_of(outputs), saved

    def backward_of_arrays(saved, gradients):
        ctx = contexts[-1]
        ctx.saved_tensors = tuple(None if array is None else torchax_tensor.Tensor(array, env) for array in saved)
        gradients = gradients if isinstance(gradients, tuple) else (gradients,)
        with env:
            grads = backward(ctx, *[torchax_tensor.Tensor(gradient, env) for gradient in gradients])
        return tuple(None if grads[index] is None else _array(grads[index]) for index in places)

    differentiable.defvjp(forward, backward_of_arrays)
    return _wrap(differentiable(*[_array(args[index]) for index in places]), env)


def register_op(op, compute, formula) -> None:
    """Makes torchax run ``op`` (a torch_pallas custom op) as ``compute`` on its tensors,
    differentiable by JAX through ``formula`` (see :func:`_run_differentiable`).

    A rule for torchax's dispatch mode (torch's open registration between an op and a mode),
    not an entry of torchax's op table: torchax's function mode runs table entries above
    torch's autograd, which would then record nothing."""

    defaults = [argument.default_value for argument in op._opoverload._schema.arguments]

    def run(mode, func, types, args, kwargs):
        args = (*args, *defaults[len(args):])  # as torch gives the autograd formula: every argument
        with mode:  # torch pops a mode while it handles an op; compute's torch calls need it
            if formula is None or not any(isinstance(arg, _TORCHAX_TENSORS) for arg in args):
                # the mode sees every op in torchax's environment, CPU tensors' too: theirs is compute
                return compute(*args, **kwargs)
            return _run_differentiable(compute, formula, _environment(args), args)

    op.register_torch_dispatch(torchax_tensor.XLADispatchMode, run)


_deferring = threading.local()


def _innermost_mode(mode_type):
    for mode in reversed(torch.overrides._get_current_function_mode_stack()):
        if isinstance(mode, mode_type):
            return mode
    return None


def defer_function_to_mode(func, mode_type) -> None:
    """Makes torchax's own rule for the torch function ``func`` offer each call to the
    innermost active ``mode_type`` first (:func:`torch_pallas.bridge.defer_function_to_mode`).

    torchax takes some torch functions whole at torch-function level
    (``F.scaled_dot_product_attention``: its reference attention) in its function mode, which
    ``with env:`` pushes onto torch's mode stack each time it is entered (every op it runs,
    every training step torchax's helpers build): a mode entered before it, as
    ``route_dropout`` around a step, would never see those calls. The rule stays torchax's
    (an entry of the default environment's op table), so calls outside the mode, and those
    the mode hands back to ``func``, run as before."""
    env = torchax.default_env()
    original = env._get_op_or_decomp(func)
    if original.is_jax_function:
        raise NotImplementedError(f"torchax's rule for {func} is a JAX function; only torch-level rules defer")

    def run_original(*args, **kwargs):
        if original.needs_env:
            kwargs = dict(kwargs, env=env)
        return original.func(*args, **kwargs)

    def rule(*args, **kwargs):
        mode = _innermost_mode(mode_type)
        if mode is None or getattr(_deferring, "active", False):
            return run_original(*args, **kwargs)
        _deferring.active = True  # the mode's own fallback, func(...), comes back here
        try:
            # torchax runs a rule with its function mode popped (it is handling this call): the
            # mode's torch calls (tensor constructors on the jax device) need it again.
            with env:
                return mode.__torch_function__(func, (), args, kwargs)
        finally:
            _deferring.active = False

    env.override_op_definition(func, rule, is_view_op=original.is_view_op)


# Sharding: a torchax tensor whose array is sharded over a JAX mesh (NamedSharding) runs each
# kernel per shard under jax.shard_map, over a mesh with one axis per split dim.

def _sharding_of_jax(sharding: jax.sharding.Sharding, rank: int) -> Sharding | None:
    hlo = sharding._to_xla_hlo_sharding(rank)
    if hlo.is_replicated():
        return None
    if not hlo.is_tiled():
        raise ValueError(f"torch_pallas runs on arrays that are tiled over a mesh or replicated; this array's "
                         f"sharding is {hlo}")
    dims = tuple(hlo.tile_assignment_dimensions())
    replicas = dims[-1] if hlo.replicate_on_last_tile_dim() else 1
    tiles = dims[:-1] if hlo.replicate_on_last_tile_dim() else dims
    if all(size == 1 for size in tiles):
        return None
    return Sharding(tuple(tiles), tuple(int(i) for i in hlo.tile_assignment_devices()), replicas)


def sharding_of(tensor: torch.Tensor) -> Sharding | None:
    """The sharding of ``tensor``'s array over JAX's devices; ``None`` for one on a single
    device, a replicated one, and inside a JAX trace (a tracer's is not read)."""
    array = _array(tensor)
    if isinstance(array, jax.core.Tracer) or len(array.sharding.device_set) == 1:
        return None
    return _sharding_of_jax(array.sharding, array.ndim)


def is_mesh(mesh) -> bool:
    return isinstance(mesh, jax.sharding.Mesh)


def sharding_from_mesh(mesh, partition_spec: Sequence) -> Sharding | None:
    """The sharding ``NamedSharding(mesh, PartitionSpec(*partition_spec))`` gives a tensor."""
    named = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*partition_spec))
    return _sharding_of_jax(named, len(partition_spec))


@functools.lru_cache(maxsize=None)
def _mesh(sharding_text: str) -> tuple[Sharding, jax.sharding.Mesh, tuple[str, ...]]:
    sharding = Sharding.parse(sharding_text)
    names = tuple(f"dim{d}" for d in range(len(sharding.tiles))) + (("replicas",) if sharding.replicas > 1 else ())
    by_id = {device.id: device for device in jax.devices()}
    devices = np.array([by_id[i] for i in sharding.device_ids]).reshape(sharding.mesh_shape)
    return sharding, jax.sharding.Mesh(devices, names), names


def _spec(names, dims) -> jax.sharding.PartitionSpec:
    return jax.sharding.PartitionSpec(*[None if d is None else names[d] for d in dims])


@functools.lru_cache(maxsize=None)
def _per_shard(jax_function, sharding_text: str, in_dims: tuple, out_dims: tuple, noise: bool, static: tuple):
    _, mesh, names = _mesh(sharding_text)
    in_specs = [_spec(names, dims) for dims in in_dims]
    function = functools.partial(jax_function, **dict(static))
    if noise:
        in_specs = [in_specs[0], jax.sharding.PartitionSpec(*names, None), *in_specs[1:]]
        function = functools.partial(with_shard_offset, kernel=function)
    out_specs = tuple(_spec(names, dims) for dims in out_dims)
    return jax.jit(jax.shard_map(function, mesh=mesh, in_specs=tuple(in_specs),
                                 out_specs=out_specs[0] if len(out_specs) == 1 else out_specs, check_vma=False))


def call_sharded(jax_function, sharding_text: str, tensors, in_dims, out_dims, noise_shape, static: dict):
    """:func:`torch_pallas.bridge.call_sharded` on torchax tensors: ``jax.shard_map`` over a mesh
    whose axis ``d`` splits dim ``d``, each device running the kernel on its shards; the
    outputs keep that sharding, with no all-gather."""
    sharding, mesh, names = _mesh(sharding_text)
    arrays = [_array(tensor) for tensor in tensors]
    in_dims = in_dims[:len(tensors)]  # an op lists the dims of operands it may leave out (indrnn's lengths)
    static = dict(static, interpret=not bridge.lowers_for_tpu())
    if noise_shape is not None:
        offsets = sharding.shard_offset_words(noise_shape, static.get("shared_over_first_dim", False))
        arrays.insert(1, jax.device_put(offsets, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
            *names, None))))
        static["global_shape"] = tuple(noise_shape)
    per_shard = _per_shard(jax_function, sharding_text, tuple(map(tuple, in_dims)), tuple(map(tuple, out_dims)),
                           noise_shape is not None, tuple(sorted(static.items())))
    return _wrap(per_shard(*arrays), _environment(tensors))


def sum_rows_in_order(rows: torch.Tensor, sharding_text: str, dims: tuple, like: torch.Tensor) -> torch.Tensor:
    """:func:`torch_pallas.bridge.sum_rows_in_order` on torchax tensors: the rows replicated on
    every device (an all-gather of this small tensor only), summed there, then placed as
    ``like``'s array is."""
    _, mesh, _ = _mesh(sharding_text)
    array = _array(rows)
    if not isinstance(array, jax.core.Tracer):
        array = jax.device_put(array, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    total = jnp.sum(array, axis=0)
    target = _array(like)
    if not isinstance(target, jax.core.Tracer):
        total = jax.device_put(total, target.sharding)
    return torchax_tensor.Tensor(total, _environment([rows]))
