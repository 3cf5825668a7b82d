"""Block-invariant random tensors on XLA devices: ``uniform``, ``normal``, ``bernoulli``.

With the portable generator (``impl="threefry"``, the default everywhere) the result is bit for
bit ``jax.random.uniform / normal / bernoulli(jax.random.key(seed), shape)`` (x64 key
semantics, see :mod:`torch_pallas.seeds`), whatever block size the kernel uses; ``normal``'s
final ``erf_inv`` may differ from JAX's by a few ulps (3 seen) in float32. With ``impl="hardware"`` (TPU
only, opt-in) the TPU's hardware PRNG is used: not bit-compatible with JAX, and as written
slower than threefry on TPU (``bench/results/tpu_cost.md``).

Seeds: ``seed=`` gives the same tensor every call; ``generator=`` (a CPU ``torch.Generator``)
draws a key from it; with neither, a key is drawn on the device from the XLA RNG, which
``torch_xla.manual_seed`` seeds (``torch.manual_seed`` does not reach XLA devices), or, for
``device="cpu"``, from torch's default generator.
"""

from __future__ import annotations

import torch

from torch_pallas import _checks, bridge, seeds, sharding
from torch_pallas.ops import sampling as sampling_ops

__all__ = ["uniform", "normal", "bernoulli", "get_default_impl", "set_default_impl"]


def get_default_impl() -> str:
    """Returns the noise generator of every random op called without ``impl=``.

    ``"threefry"`` unless changed by :func:`set_default_impl` or, when the process starts,
    by the environment variable ``TORCH_PALLAS_NOISE_IMPL`` (as ``JAX_DEFAULT_PRNG_IMPL``
    sets ``jax.random``'s).

    Raises:
        ValueError: the environment names an unknown impl, or ``"hardware"`` off TPU.
    """
    return _checks.resolve_impl(None)


def set_default_impl(impl: str | None) -> None:
    r"""Sets the noise generator of every random op called without ``impl=``: dropout (the
    functions, modules, :func:`torch_pallas.route_dropout`), channel dropout,
    :func:`uniform`, :func:`normal` and :func:`bernoulli`. An explicit ``impl=`` still wins.

    Process-wide, as ``jax.config.update("jax_default_prng_impl", ...)`` is for JAX; under
    ``torch.compile`` a change recompiles the functions that read it. Modules read it when
    they run, not when they are built.

    Args:
        impl (str or None): ``"threefry"`` (bit for bit ``jax.random``, equal on every
            backend) or ``"hardware"`` (the TPU's hardware PRNG; TPU only); ``None``
            restores the environment's choice (``TORCH_PALLAS_NOISE_IMPL``) or
            ``"threefry"``.

    Raises:
        ValueError: an unknown ``impl``, or ``"hardware"`` off TPU.

    Example::

        >>> torch_pallas.random.set_default_impl("hardware")   # on a TPU VM
        >>> y = torch_pallas.dropout(x, 0.1)                    # the hardware PRNG
    """
    if impl is not None:
        _checks.resolve_impl(impl)
    bridge.set_default_noise_impl(impl)


def _sample(distribution, shape, *, p, seed, generator, device, dtype, impl, mesh, partition_spec):
    shape = _checks.check_shape(shape)
    p, impl = _checks.noise_arguments(p, impl, seed, generator)
    device = bridge.device_or_default(device)
    output_sharding = sharding.resolve(None, mesh, partition_spec)
    sharding_text = None if output_sharding is None else output_sharding.check(shape, "shape", impl)
    return sampling_ops.sample(seeds.draw(seed, generator, device), shape, distribution=distribution, dtype=dtype, p=p,
                              impl=impl, sharding_text=sharding_text)


def uniform(shape, *, seed=None, generator=None, device=None, dtype=torch.float32, impl=None, mesh=None,
            partition_spec=None) -> torch.Tensor:
    r"""Returns a tensor of ``shape`` filled with numbers drawn uniformly from :math:`[0, 1)`.

    Args:
        shape (int or sequence of ints): the output's shape.
        seed (int, optional): a seed in :math:`[0, 2^{64})`; the same seed gives the same tensor.
        generator (torch.Generator, optional): a CPU generator to draw the key from.
        device (torch.device, optional): an XLA device, torchax's ``jax`` device or the CPU
            (where the same kernels run through JAX and give the same numbers); default the
            stack's device (``torch_xla.device()``; ``jax`` with torchax).
        dtype (torch.dtype): ``torch.float32`` (default), ``torch.bfloat16`` or ``torch.float16``.
        impl (str, optional): ``"threefry"`` (portable, bit-compatible with ``jax.random``) or
            ``"hardware"`` (TPU only); default :func:`get_default_impl` (``"threefry"``
            unless changed).
        mesh (torch_xla.distributed.spmd.Mesh, optional), partition_spec (tuple, optional):
            in SPMD mode (``torch_xla.runtime.use_spmd()``), return a tensor sharded as
            ``xs.mark_sharding(t, mesh, partition_spec)`` would shard it, each device drawing
            only its own shard: the numbers are those of the unsharded tensor. Give both or
            neither.

    Returns:
        Tensor: on ``device``, of ``shape`` and ``dtype``.

    Raises:
        TypeError: a non-integer size or seed, a non-float ``dtype``.
        ValueError: a negative size, a seed outside :math:`[0, 2^{64})`, both ``seed`` and
            ``generator``, an unknown ``impl`` or ``impl="hardware"`` off TPU, a ``device``
            that is none of those,
            ``mesh`` without ``partition_spec`` (or the reverse), a mesh outside SPMD mode, a
            partition spec of another rank than ``shape``, or a sharding the kernel cannot
            take (uneven shards, more than two split dims besides the first, with
            ``impl="hardware"`` shards that are not whole bands of tiles: see the README).

    Example::

        >>> x = torch_pallas.random.uniform((2, 3), seed=0)
        >>> x.device.type
        'xla'
    """
    _checks.check_float_dtype(dtype)
    return _sample("uniform", shape, p=0.5, seed=seed, generator=generator, device=device, dtype=dtype, impl=impl,
                   mesh=mesh, partition_spec=partition_spec)


def normal(shape, *, seed=None, generator=None, device=None, dtype=torch.float32, impl=None, mesh=None,
           partition_spec=None) -> torch.Tensor:
    r"""Returns a tensor of ``shape`` filled with standard normal numbers (mean 0, variance 1).

    Arguments, result and errors are those of :func:`uniform`.
    """
    _checks.check_float_dtype(dtype)
    return _sample("normal", shape, p=0.5, seed=seed, generator=generator, device=device, dtype=dtype, impl=impl,
                   mesh=mesh, partition_spec=partition_spec)


def bernoulli(shape, p=0.5, *, seed=None, generator=None, device=None, impl=None, mesh=None,
              partition_spec=None) -> torch.Tensor:
    r"""Returns a ``torch.bool`` tensor of ``shape`` whose elements are True with probability ``p``.

    An element is True when its float32 uniform number is below ``float32(p)``, as in
    ``jax.random.bernoulli``. ``p`` is compiled into the kernel: each distinct value
    compiles once.

    Args:
        shape (int or sequence of ints): the output's shape.
        p (float): the probability of True, in :math:`[0, 1]`.
        seed, generator, device, impl, mesh, partition_spec: as in :func:`uniform`.

    Raises:
        ValueError: ``p`` outside :math:`[0, 1]` or NaN, and the errors of :func:`uniform`.
        TypeError: ``p`` not a real number, and the errors of :func:`uniform`.
    """
    return _sample("bernoulli", shape, p=p, seed=seed, generator=generator, device=device,
                   dtype=torch.float32, impl=impl, mesh=mesh, partition_spec=partition_spec)
