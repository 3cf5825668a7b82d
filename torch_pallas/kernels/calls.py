"""What every kernel's ``pallas_call`` tells XLA besides its body: a name and a cost estimate.

The name (:func:`kernel_name`) is the kernel, its phase and variant, and its blocks, such as
``dropout_threefry_b256x1024``: the custom call's ``op_name`` is ``.../NAME/pallas_call``, which
TPU profiles and HLO dumps show (jax 0.10 names the HLO instruction after it too). The cost
estimate (:func:`cost_estimate`), from the kernel's own counts, is what XLA's cost analysis
and its TPU scheduler take the custom call to cost: without one a Mosaic custom call counts no
flops and no total bytes. :func:`pallas_call` is ``pl.pallas_call`` with both.
"""

from __future__ import annotations

import math

from jax.experimental import pallas as pl

from torch_pallas.kernels import compat


def kernel_name(kernel: str, *variants, blocks) -> str:
    """``kernel``, the non-empty ``variants`` (phase, noise impl, options) and ``blocks`` (the
    block's dims) joined by underscores, the blocks as ``b256x1024``: stable for a static
    configuration, and a valid identifier.

    Raises:
        ValueError: the result is not an identifier (a variant with other characters).
    """
    name = "_".join([kernel, *(str(variant) for variant in variants if variant),
                     "b" + "x".join(str(int(size)) for size in blocks)])
    if not name.isidentifier():
        raise ValueError(f"a kernel name must be an identifier, got {name!r}")
    return name


def nbytes(*arrays) -> int:
    """Bytes of ``arrays`` (arrays or ``jax.ShapeDtypeStruct``; ``None`` skipped)."""
    return sum(math.prod(array.shape) * array.dtype.itemsize for array in arrays if array is not None)


def cost_estimate(*, bytes_accessed, flops, transcendentals=0) -> pl.CostEstimate:
    """A kernel's cost for XLA: ``bytes_accessed``, what its blocks move between HBM and VMEM
    (its operands and outputs, a block read again where its BlockSpec fetches it again);
    ``flops``, its arithmetic (a matrix product ``2 * M * N * K``, elementwise work a few per
    element, the noise's integer work as :func:`torch_pallas.kernels.prng.noise_ops` counts
    it); ``transcendentals``, its exponentials, logarithms and the like. Rounded to ints."""
    return pl.CostEstimate(flops=round(flops), transcendentals=round(transcendentals),
                           bytes_accessed=round(bytes_accessed))


def pallas_call(kernel, *, name: str, cost_estimate: pl.CostEstimate, **options):
    """``pl.pallas_call(kernel, name=name, cost_estimate=cost_estimate, **options)``, called in
    the name's scope on every JAX version (:func:`compat.kernel_scope`)."""
    call = pl.pallas_call(kernel, name=name, cost_estimate=cost_estimate, **options)

    def named_call(*args):
        with compat.kernel_scope(name):
            return call(*args)
    return named_call
