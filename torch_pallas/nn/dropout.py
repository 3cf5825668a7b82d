"""Dropout modules: :class:`Dropout` (a drop-in :class:`torch.nn.Dropout`), its channel
variants, and :func:`convert_dropout`."""

from __future__ import annotations

import logging

import torch

from torch_pallas import _checks, residual_fusion, routing, sharding
from torch_pallas.functional import dropout1d, dropout2d, dropout3d, dropout as dropout_fn, dropout_under_sharding

__all__ = ["Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "convert_dropout"]

_logger = logging.getLogger("torch_pallas")


class _KeyedDropout:
    """What the dropout modules share: torch's ``(p, inplace)`` plus ``impl``, and the call."""

    def __init__(self, p: float = 0.5, inplace: bool = False, *, impl=None):
        super().__init__(_checks.check_probability(p), inplace)
        _checks.resolve_impl(impl)
        self.impl = impl

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if isinstance(input, torch.fx.Proxy):
            return _recorded_by_fx(self, input)
        return self._function(input, self.p, self.training, self.inplace, impl=self.impl)

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", impl={self.impl!r}" if self.impl is not None else "")


def _recorded_by_fx(module: torch.nn.Module, input: torch.fx.Proxy) -> torch.fx.Proxy:
    """The call of ``module`` as ``torch.fx``'s symbolic tracing records it: one call of the module
    (a leaf, as torch's own dropout modules are), which runs it when the traced graph runs. fx
    takes only ``torch.nn``'s modules for leaves and traces into every other module's
    ``forward``, whose argument checks take tensors, not proxies."""
    tracer = input.tracer
    return tracer.create_proxy("call_module", tracer.path_of_module(module), (input,), {})


class Dropout(_KeyedDropout, torch.nn.Dropout):
    r"""During training, zeroes elements with probability ``p`` and scales the rest by :math:`1/(1-p)`.

    A drop-in for :class:`torch.nn.Dropout` (a subclass of it, with its signature and repr),
    and the reference for dropout here: :func:`torch_pallas.dropout` is this module as a
    function. Each call draws a fresh key (:ref:`where keys come from <key-sources>`) and the
    backward pass regenerates the mask from that 8-byte key instead of storing it: the
    autograd graph keeps 8 bytes per call instead of a mask as large as the input. The mask
    is the same whatever the device, the stack or the kernels' block sizes: with the default
    ``impl="tiled"`` an element is kept when its 16-bit uniform number is at least
    ``round(p * 65536)``; with ``impl="threefry"`` when its float32 uniform number is below
    ``float32(1 - p)``, bit for bit ``jax.random.bernoulli(key, 1 - p, input.shape)``
    (:ref:`dropout's mask <dropout-mask>`). As torch's dropout computes ``input * mask``, a
    dropped NaN or infinity gives NaN, forward and backward, not 0. A float64 input gets the mask float32 gets from
    the same key (the kernel draws it; Mosaic has no float64), applied in float64. A sharded
    input runs shard by shard on its devices, forward and backward, the output and gradient
    keep its sharding, and the mask is the unsharded one. In ``eval()`` mode it returns its
    input, whatever its device and dtype.

    Args:
        p (float): probability of an element being zeroed, in :math:`[0, 1]`. ``p == 0``
            returns the input; ``p == 1`` returns ``input * 0`` (zeros, with zero gradient).
            Default: 0.5.
        inplace (bool): write the result into the input and return it, as
            :class:`torch.nn.Dropout` does (the gradient still flows through the mask).
            Default: ``False``.
        impl (str, optional): the noise generator, ``"tiled"``, ``"threefry"`` or
            ``"hardware"`` (TPU only) (:ref:`noise generators <noise-impls>`); default
            :func:`torch_pallas.random.get_default_impl` (``"tiled"`` unless changed), read
            at each call.
        mesh, partition_spec: in SPMD mode, how the input is sharded (as ``xs.mark_sharding``
            takes them; a ``jax.sharding.Mesh`` on torchax), resolved when the module is
            built: the kernel then runs on each device's shard, also under ``torch.compile``
            and for intermediate activations, whose sharding is otherwise not visible
            (:ref:`sharded tensors <sharding-limits>`). Give both or neither.

    Shape:
        - Input: any shape (with ``partition_spec``, of its rank); in training mode float32,
          bfloat16, float16 or float64 (:ref:`dtypes`) on a device torch_pallas runs on
          (:ref:`devices`).
        - Output: the input's shape and dtype.

    Raises:
        TypeError: ``p`` is not a real number.
        ValueError: ``p`` outside :math:`[0, 1]` or NaN, an unknown ``impl``,
            ``impl="hardware"`` off TPU, or only one of ``mesh`` and ``partition_spec``.
    """

    _function = staticmethod(dropout_fn)

    def __init__(self, p: float = 0.5, inplace: bool = False, *, impl=None, mesh=None, partition_spec=None):
        super().__init__(p, inplace, impl=impl)
        # Resolved when built: torch.compile cannot trace torch_xla's mesh code.
        self._sharding = sharding.resolve(None, mesh, partition_spec)
        self.mesh, self.partition_spec = mesh, None if partition_spec is None else tuple(partition_spec)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if isinstance(input, torch.fx.Proxy):
            return _recorded_by_fx(self, input)
        route = routing.fusing_route(input)
        if route is not None or residual_fusion.is_attention_weights(input):
            # As a routed F.dropout: the mask of attention weights, and what reads the output
            # may run fused with it (with a partition_spec, per shard: FSDPv2's LoRA dropouts
            # before their lora_A).
            _checks.check_tensor(input, "input")
            output = residual_fusion.routed_dropout(input, self.p, self.training, self.impl, self._sharding,
                                                    fusing=route is not None and not self.inplace)
            return input.copy_(output) if self.inplace and output is not input else output
        if self.mesh is None:
            return super().forward(input)
        _checks.check_tensor(input, "input")
        return dropout_under_sharding(input, self.p, self.training, self.inplace, impl=self.impl,
                                      sharding=self._sharding)

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", partition_spec={self.partition_spec!r}" if self.mesh is not None else "")


_CHANNEL_DOC = r"""During training, zeroes entire channels with probability ``p`` and scales the rest by
    :math:`1/(1-p)`: a drop-in for :class:`torch.nn.{name}` (a subclass of it, with its
    signature and repr). Each call draws a fresh key, as :class:`Dropout`'s; the mask has one
    element per (sample, channel). In ``eval()`` mode it returns its input.
    See :func:`torch_pallas.functional.{function}`.

    Args:
        p (float): probability of a channel being zeroed, in :math:`[0, 1]`. Default: 0.5.
        inplace, impl: as :class:`Dropout` takes them.

    Shape:
        - Input: ``{batched}`` or ``{unbatched}``; in training mode as :class:`Dropout`'s.
        - Output: the input's shape and dtype.

    Raises:
        TypeError, ValueError: as :class:`Dropout`.
    """


class Dropout1d(_KeyedDropout, torch.nn.Dropout1d):
    __doc__ = _CHANNEL_DOC.format(name="Dropout1d", function="dropout1d", batched="(N, C, L)", unbatched="(C, L)")
    _function = staticmethod(dropout1d)


class Dropout2d(_KeyedDropout, torch.nn.Dropout2d):
    __doc__ = _CHANNEL_DOC.format(name="Dropout2d", function="dropout2d", batched="(N, C, H, W)",
                                  unbatched="(N, C, L)")
    _function = staticmethod(dropout2d)


class Dropout3d(_KeyedDropout, torch.nn.Dropout3d):
    __doc__ = _CHANNEL_DOC.format(name="Dropout3d", function="dropout3d", batched="(N, C, D, H, W)",
                                  unbatched="(C, D, H, W)")
    _function = staticmethod(dropout3d)


_REPLACEMENTS = {torch.nn.Dropout: Dropout, torch.nn.Dropout1d: Dropout1d, torch.nn.Dropout2d: Dropout2d,
                 torch.nn.Dropout3d: Dropout3d}


def convert_dropout(model: torch.nn.Module, *, impl=None, mesh=None, partition_spec=None) -> torch.nn.Module:
    """Replaces every :class:`torch.nn.Dropout`, ``Dropout1d``, ``Dropout2d`` and ``Dropout3d``
    in ``model`` (nested too) with its torch_pallas counterpart (:class:`Dropout`, ...).

    Each replacement keeps the original's ``p``, ``inplace`` and training mode.
    ``AlphaDropout`` and ``FeatureAlphaDropout`` (other semantics) are left alone, as are
    other subclasses. Dropout that is not a module (``F.dropout`` calls in ``forward``, as
    in OPT or Llama) is out of this function's reach: run the model inside
    :func:`torch_pallas.route_dropout` to reach it. The ``torch_pallas`` logger says what
    was converted, and a warning says so when nothing was.

    Args:
        model (nn.Module): converted in place.
        impl (str, optional): passed to every new module.
        mesh, partition_spec: passed to every new :class:`Dropout` (not to the channel
            variants, which run on
            the whole tensor): in SPMD mode, how the activations they see are sharded, for
            example ``("fsdp", None, None)`` for the (batch, sequence, features) activations
            of a model trained with FSDPv2. Every such dropout must then see tensors of
            that rank (a ValueError otherwise). Give both or neither.

    Returns:
        nn.Module: ``model``, or the replacement if ``model`` itself is a dropout module.

    Raises:
        ValueError: an unknown ``impl``, ``impl="hardware"`` off TPU, only one of ``mesh``
            and ``partition_spec``, or a mesh outside SPMD mode.
    """
    _checks.resolve_impl(impl)
    sharding.resolve(None, mesh, partition_spec)  # raises before anything is replaced
    sharded = dict(mesh=mesh, partition_spec=partition_spec)
    if type(model) in _REPLACEMENTS:
        return _replacement(model, impl, sharded)
    converted = []
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if type(child) in _REPLACEMENTS:
                setattr(parent, name, _replacement(child, impl, sharded))
                converted.append(f"{parent_name}.{name}" if parent_name else name)
    _logger.info("convert_dropout: converted %d dropout modules: %s", len(converted), ", ".join(converted))
    if not converted:
        _checks.warn(f"convert_dropout found no nn.Dropout/Dropout1d/2d/3d module in {type(model).__name__}; "
                     "if its forward calls F.dropout, run it inside torch_pallas.route_dropout()", stacklevel=2)
    return model


def _replacement(module: torch.nn.Module, impl, sharded: dict) -> torch.nn.Module:
    options = sharded if type(module) is torch.nn.Dropout else {}
    replacement = _REPLACEMENTS[type(module)](module.p, module.inplace, impl=impl, **options)
    replacement.train(module.training)
    return replacement
