"""Block-invariant random tensors: ``uniform``, ``normal``, ``bernoulli``, and the noise
generators random ops use by default (:func:`get_default_impl`, :func:`set_default_impl`).

With ``impl="threefry"`` (their default) the result is bit for bit ``jax.random.uniform /
normal / bernoulli(key, shape)`` for the seed's key, whatever block size the kernel uses
(``normal`` in float32 to a few ulps): :ref:`the noise contract <noise-impls>` says exactly what
each generator draws, and :ref:`where keys come from <key-sources>` what ``seed=`` and
``generator=`` do.
"""

from __future__ import annotations

import torch

from torch_pallas import _checks, bridge, dtensors, seeds, sharding
from torch_pallas.kernels import arguments
from torch_pallas.ops import sampling as sampling_ops

__all__ = ["uniform", "normal", "bernoulli", "get_default_impl", "set_default_impl"]


def get_default_impl(kind: str = "dropout") -> str:
    """Returns the noise generator of ``kind``'s random ops called without ``impl=``.

    Unless changed by :func:`set_default_impl` or, when the process starts, by the
    environment variable ``TORCH_PALLAS_NOISE_IMPL`` (as ``JAX_DEFAULT_PRNG_IMPL`` sets
    ``jax.random``'s), that is ``"tiled"`` for ``kind="dropout"`` (dropout and every op
    built on it: the channel variants, :func:`torch_pallas.dropout_add`,
    :func:`torch_pallas.dropout_matmul`, attention's dropout, the modules,
    :func:`torch_pallas.route_dropout`, IndRNN's dropout) and ``"threefry"`` for
    ``kind="sampling"`` (:func:`uniform`, :func:`normal`, :func:`bernoulli`, which are
    ``jax.random``'s bits): :ref:`the generators <noise-impls>` says why.

    Args:
        kind (str): ``"dropout"`` (default) or ``"sampling"``.

    Raises:
        ValueError: an unknown ``kind``, the environment names an unknown impl, or
            ``"hardware"`` off TPU.
    """
    return _checks.resolve_impl(None, arguments.check_one_of("kind", kind, _checks.KINDS))


def set_default_impl(impl: str | None) -> None:
    r"""Sets the noise generator of every random op called without ``impl=``: dropout (the
    functions, modules, :func:`torch_pallas.route_dropout`, attention), channel dropout,
    :func:`uniform`, :func:`normal` and :func:`bernoulli`. An explicit ``impl=`` still wins.

    Process-wide, as ``jax.config.update("jax_default_prng_impl", ...)`` is for JAX; under
    ``torch.compile`` a change recompiles the functions that read it. Modules read it when
    they run, not when they are built. ``set_default_impl("threefry")`` gives every op
    ``jax.random``'s bits, as the dropouts drew them before ``"tiled"`` became their default.

    Args:
        impl (str or None): ``"threefry"``, ``"tiled"`` or ``"hardware"`` (TPU only;
            :ref:`the generators <noise-impls>`); ``None`` restores the environment's choice
            (``TORCH_PALLAS_NOISE_IMPL``) or, without one, each kind's default
            (:func:`get_default_impl`).

    Raises:
        ValueError: an unknown ``impl``, or ``"hardware"`` off TPU.

    Example::

        >>> torch_pallas.random.set_default_impl("threefry")   # jax.random's masks, as before 0.2
        >>> y = torch_pallas.dropout(x, 0.1, seed=0)            # jax.random.bernoulli's mask
    """
    if impl is not None:
        _checks.resolve_impl(impl)
    bridge.choose_noise_impl(impl)


def _sample(distribution, shape, *, p, seed, generator, device, dtype, impl, mesh, partition_spec, device_mesh,
            placements):
    shape = _checks.check_shape(shape)
    p, impl = _checks.noise_arguments(p, impl, seed, generator, kind=_checks.SAMPLING)
    if device_mesh is not None or placements is not None:
        if device_mesh is None or placements is None or mesh is not None or partition_spec is not None:
            raise ValueError("device_mesh and placements go together (a DTensor's layout), and not with mesh and "
                             "partition_spec (SPMD's)")
        dtensors.check_layout(device_mesh, placements)
        device = bridge.device_or_default(device if device is not None else torch.device(device_mesh.device_type))
        key_data = seeds.draw(seed, generator, device)

        def sample_block(block_shape, **where):
            return sampling_ops.sample(key_data, block_shape, distribution=distribution, dtype=dtype, p=p, impl=impl,
                                       **where)

        return dtensors.sample_on_mesh(shape, device_mesh, placements, sample_block, impl=impl)
    device = bridge.device_or_default(device)
    output_sharding = sharding.resolve(None, mesh, partition_spec)
    sharding_text = None if output_sharding is None else output_sharding.check(shape, "shape", impl)
    return sampling_ops.sample(seeds.draw(seed, generator, device), shape, distribution=distribution, dtype=dtype, p=p,
                              impl=impl, sharding_text=sharding_text)


def uniform(shape, *, seed=None, generator=None, device=None, dtype=torch.float32, impl=None, mesh=None,
            partition_spec=None, device_mesh=None, placements=None) -> torch.Tensor:
    r"""Returns a tensor of ``shape`` filled with numbers drawn uniformly from :math:`[0, 1)`.

    Args:
        shape (int or sequence of ints): the output's shape.
        seed, generator: as for :func:`torch_pallas.dropout`: the same seed gives the same tensor.
        device (torch.device, optional): where the tensor is created (:ref:`devices`; the
            same numbers on each); default the stack's device.
        dtype (torch.dtype): ``torch.float32`` (default), ``torch.bfloat16`` or ``torch.float16``.
        impl (str, optional): the noise generator, as :class:`torch_pallas.nn.Dropout` takes it.
        mesh, partition_spec: in SPMD mode (``torch_xla.runtime.use_spmd()``; a JAX mesh on
            torchax), return a tensor sharded as
            ``xs.mark_sharding(t, mesh, partition_spec)`` would shard it, each device drawing
            only its own shard: the numbers are those of the unsharded tensor. Give both or
            neither.
        device_mesh, placements: a ``torch.distributed`` ``DeviceMesh`` and one ``Shard`` or
            ``Replicate`` per mesh dim, as torch's DTensor factories take them
            (``torch.distributed.tensor.rand``): return a DTensor, each rank drawing only its
            shard of the unsharded tensor's numbers (:ref:`DTensors <dtensors>`); ``device``
            defaults to the mesh's. Ranks draw alike from a ``seed`` or seeded generators.

    Returns:
        Tensor: on ``device``, of ``shape`` and ``dtype``.

    Raises:
        TypeError: a non-integer size or seed, a non-float ``dtype``.
        ValueError: a negative size, a seed outside :math:`[0, 2^{64})`, both ``seed`` and
            ``generator``, an unknown ``impl`` or ``impl="hardware"`` off TPU, a ``device``
            that is none of those,
            ``mesh`` without ``partition_spec`` (or the reverse), a mesh outside SPMD mode, a
            partition spec of another rank than ``shape``, or a sharding the kernel cannot
            take (uneven shards; with ``impl="threefry"``, more than two split dims besides
            the first: :ref:`sharded tensors <sharding-limits>`); ``device_mesh`` without ``placements`` (or
            the reverse, or with ``mesh``), placements other than one ``Shard`` or ``Replicate``
            per mesh dim.

    Example::

        >>> x = torch_pallas.random.uniform((2, 3), seed=0)
        >>> x.device.type
        'xla'
    """
    _checks.check_float_dtype(dtype)
    return _sample("uniform", shape, p=0.5, seed=seed, generator=generator, device=device, dtype=dtype, impl=impl,
                   mesh=mesh, partition_spec=partition_spec, device_mesh=device_mesh, placements=placements)


def normal(shape, *, seed=None, generator=None, device=None, dtype=torch.float32, impl=None, mesh=None,
           partition_spec=None, device_mesh=None, placements=None) -> torch.Tensor:
    r"""Returns a tensor of ``shape`` filled with standard normal numbers (mean 0, variance 1).

    Arguments, result and errors are those of :func:`uniform`.
    """
    _checks.check_float_dtype(dtype)
    return _sample("normal", shape, p=0.5, seed=seed, generator=generator, device=device, dtype=dtype, impl=impl,
                   mesh=mesh, partition_spec=partition_spec, device_mesh=device_mesh, placements=placements)


def bernoulli(shape, p=0.5, *, seed=None, generator=None, device=None, impl=None, mesh=None,
              partition_spec=None, device_mesh=None, placements=None) -> torch.Tensor:
    r"""Returns a ``torch.bool`` tensor of ``shape`` whose elements are True with probability ``p``.

    An element is True when its float32 uniform number is below ``float32(p)``, as in
    ``jax.random.bernoulli``. ``p`` is compiled into the kernel: each distinct value
    compiles once.

    Args:
        shape (int or sequence of ints): the output's shape.
        p (float): the probability of True, in :math:`[0, 1]`.
        seed, generator, device, impl, mesh, partition_spec, device_mesh, placements: as in
            :func:`uniform`.

    Raises:
        ValueError: ``p`` outside :math:`[0, 1]` or NaN, and the errors of :func:`uniform`.
        TypeError: ``p`` not a real number, and the errors of :func:`uniform`.
    """
    return _sample("bernoulli", shape, p=p, seed=seed, generator=generator, device=device,
                   dtype=torch.float32, impl=impl, mesh=mesh, partition_spec=partition_spec, device_mesh=device_mesh,
                   placements=placements)
