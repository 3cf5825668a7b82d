"""Modules: :class:`Dropout` (a drop-in :class:`torch.nn.Dropout`), :func:`convert_dropout`, :class:`IndRNN`."""

from __future__ import annotations

import logging
import math
import numbers

import torch
from torch.nn.utils.rnn import PackedSequence

from torch_pallas import _checks, sharding
from torch_pallas.functional import _dropout, _indrnn, dropout1d, dropout2d, dropout3d, dropout as dropout_fn
from torch_pallas.kernels.indrnn import check_nonlinearity
from torch_pallas.packing import Padded, reverse_each

__all__ = ["Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "IndRNN", "convert_dropout"]

_logger = logging.getLogger("torch_pallas")


class _KeyedDropout:
    """What the dropout modules share: torch's ``(p, inplace)`` plus ``impl``, and the call."""

    def __init__(self, p: float = 0.5, inplace: bool = False, *, impl=None):
        super().__init__(_checks.check_probability(p), inplace)
        _checks.resolve_impl(impl)
        self.impl = impl

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._function(input, self.p, self.training, self.inplace, impl=self.impl)

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", impl={self.impl!r}" if self.impl is not None else "")


class Dropout(_KeyedDropout, torch.nn.Dropout):
    r"""During training, zeroes elements with probability ``p`` and scales the rest by :math:`1/(1-p)`.

    A drop-in for :class:`torch.nn.Dropout` (a subclass of it, with its signature and repr)
    on XLA devices: each call draws a fresh key from the XLA RNG (reproducible after
    ``torch_xla.manual_seed``; on the CPU, from torch's generator), and the backward pass
    regenerates the mask from that 8-byte key instead of storing it. In ``eval()`` mode it
    returns its input, whatever its device and dtype. See :func:`torch_pallas.dropout`.

    Args:
        p (float): probability of an element being zeroed, in :math:`[0, 1]`. Default: 0.5.
        inplace (bool): write the result into the input and return it, as
            :class:`torch.nn.Dropout` does. Default: ``False``.
        impl (str, optional): ``"threefry"`` or ``"hardware"`` (TPU only); default
            :func:`torch_pallas.random.get_default_impl` (``"threefry"`` unless changed).

        mesh (torch_xla.distributed.spmd.Mesh, optional), partition_spec (tuple, optional):
            in SPMD mode, how the input is sharded (as ``xs.mark_sharding`` takes it): the
            kernel then runs on each device's shard, also under ``torch.compile`` and for
            intermediate activations, whose sharding is otherwise not visible (see
            :func:`torch_pallas.dropout`). Give both or neither.

    Shape:
        - Input: any shape (with ``partition_spec``, of its rank); in training mode float32,
          bfloat16, float16 or float64 on an XLA device or the CPU.
        - Output: the input's shape and dtype.

    Raises:
        TypeError: ``p`` is not a real number.
        ValueError: ``p`` outside :math:`[0, 1]` or NaN, an unknown ``impl``,
            ``impl="hardware"`` off TPU, or only one of ``mesh`` and ``partition_spec``.
    """

    _function = staticmethod(dropout_fn)

    def __init__(self, p: float = 0.5, inplace: bool = False, *, impl=None, mesh=None, partition_spec=None):
        super().__init__(p, inplace, impl=impl)
        self.mesh, self.partition_spec, self._sharding = _module_sharding(mesh, partition_spec)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.mesh is None:
            return super().forward(input)
        _checks.check_tensor(input, "input")
        return _dropout(input, self.p, self.training, self.inplace, None, None, self.impl, False, self._sharding)

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", partition_spec={self.partition_spec!r}" if self.mesh is not None else "")


def _module_sharding(mesh, partition_spec, order=None):
    """``(mesh, partition_spec as a tuple, the Sharding it gives)``, all ``None`` when neither
    is given. Resolved when the module is built: torch.compile cannot trace torch_xla's mesh
    code. ``order`` permutes the spec first (to the layout the kernels see)."""
    if mesh is None and partition_spec is None:
        return None, None, None
    spec = None if partition_spec is None else tuple(partition_spec)
    kernel_spec = spec if order is None or spec is None else tuple(spec[d] for d in order)
    return mesh, spec, sharding.resolve(None, mesh, kernel_spec)


_CHANNEL_DOC = r"""During training, zeroes entire channels with probability ``p`` and scales the rest by
    :math:`1/(1-p)`: a drop-in for :class:`torch.nn.{name}` (a subclass of it, with its
    signature and repr) on XLA devices (and the CPU). Each call draws a fresh key from the
    RNG of the input's device; the
    mask has one element per (sample, channel). In ``eval()`` mode it returns its input.
    See :func:`torch_pallas.functional.{function}`.

    Args:
        p (float): probability of a channel being zeroed, in :math:`[0, 1]`. Default: 0.5.
        inplace (bool): write the result into the input and return it. Default: ``False``.
        impl (str, optional): ``"threefry"`` or ``"hardware"`` (TPU only); default
            :func:`torch_pallas.random.get_default_impl` (``"threefry"`` unless changed).

    Shape:
        - Input: ``{batched}`` or ``{unbatched}``; in training mode float32, bfloat16,
          float16 or float64 on an XLA device or the CPU.
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
        mesh (torch_xla.distributed.spmd.Mesh, optional), partition_spec (tuple, optional):
            passed to every new :class:`Dropout` (not to the channel variants, which run on
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
    _module_sharding(mesh, partition_spec)  # raises before anything is replaced
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


class _RNNInputError(ValueError, RuntimeError):
    """Bad input to :meth:`IndRNN.forward` where :class:`torch.nn.RNN` raises RuntimeError:
    a ValueError like every other argument error of torch_pallas, which code written for
    nn.RNN (``except RuntimeError``) still catches."""


def _check_positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


class IndRNN(torch.nn.Module):
    r"""A multi-layer IndRNN (Li et al., 2018), with :class:`torch.nn.RNN`'s conventions.

    Each layer projects its input and runs the elementwise recurrence in Pallas kernels
    (:func:`torch_pallas.indrnn`)::

        h_t = act(W_ih x_t + b_ih + w_hh * h_{t-1})

    where ``w_hh`` has one recurrent weight per hidden unit.

    Args:
        input_size (int): features of the input.
        hidden_size (int): features of the hidden state.
        num_layers (int): stacked layers. Default: 1.
        nonlinearity (str): ``"relu"`` (default) or ``"tanh"``.
        bias (bool): whether the input projections have a bias. Default: True.
        batch_first (bool): input and output as ``(B, T, features)``. Default: False.
        dropout (float): dropout probability on the outputs of every layer but the last.
            One mask per sequence is shared by all time steps (regenerated in the backward
            pass from an 8-byte key, never stored). Default: 0.
        bidirectional (bool): run every layer in both directions. Default: False.
        recurrent_max_abs (float, optional): bound on :math:`|w_{hh}|`, enforced at
            initialisation and by :meth:`clip_recurrent_weights`, which you call after each
            optimizer step (or let :meth:`clip_after` register it as a step hook).
        mesh (torch_xla.distributed.spmd.Mesh, optional), partition_spec (tuple, optional):
            in SPMD mode, how a padded batched input is sharded (in its own layout, batch
            first or not; time must not be split): every layer's recurrence and dropout then
            run on each device's shard, also under ``torch.compile``. Give both or neither.

    Parameters (for layer ``k``; ``_reverse`` suffix for the backward direction):
        weight_ih_l{k}: ``(hidden_size, input_size)`` for ``k = 0``, else
            ``(hidden_size, num_directions * hidden_size)``; uniform in
            :math:`(-1/\sqrt{hidden}, 1/\sqrt{hidden})`, as in :class:`torch.nn.RNN`.
        bias_ih_l{k}: ``(hidden_size,)``, initialised like ``weight_ih``.
        weight_hh_l{k}: ``(hidden_size,)`` recurrent weights, uniform in :math:`(0, 1)` as in
            the IndRNN paper (clipped to ``recurrent_max_abs`` when given).

    Inputs: ``input, hx``
        input: ``(T, B, input_size)``, ``(B, T, input_size)`` with ``batch_first``,
            ``(T, input_size)`` unbatched, or a :class:`~torch.nn.utils.rnn.PackedSequence`
            of sequences of different lengths; float, on an XLA device or the CPU. Build a packed
            batch on the CPU and move it with ``.to(device)``, or with
            :func:`torch_pallas.packing.pack_padded_sequence`: torch_xla 2.9's
            ``pack_padded_sequence`` / ``pack_sequence`` return wrong data for XLA tensors.
        hx: ``(num_layers * num_directions, B, hidden_size)`` (no ``B`` if unbatched); zeros
            if omitted.

    Outputs: ``output, h_n``
        output: ``(T, B, num_directions * hidden_size)`` (batch first if ``batch_first``), or
            a :class:`~torch.nn.utils.rnn.PackedSequence` for a packed input.
        h_n: ``(num_layers * num_directions, B, hidden_size)``, the last state of every layer
            and direction (the state after the first time step for the reverse direction).
            For a packed input, as :class:`torch.nn.RNN`: each sequence's state stops at its
            own length (the kernels take the lengths as data, so new lengths compile no new
            kernel), the reverse direction starts at each sequence's last step, and nothing
            flows back from the padding. Under ``torch.compile`` every new set of lengths is
            a new packed shape and compiles anew.

    Raises:
        ValueError: bad sizes, ``nonlinearity``, ``dropout`` or ``recurrent_max_abs`` at
            construction; in :meth:`forward`, as :class:`torch.nn.RNN`: an input or ``hx``
            whose dtype is not the parameters' (unless autocast is on; integer inputs such
            as token ids always), an input with no time step, input or ``hx`` of the wrong
            rank or size, or on another device than the parameters. Where nn.RNN raises
            RuntimeError instead (no time step, the ``hx`` dtype, sizes), the error is also
            a RuntimeError.
        TypeError: an input that is neither a tensor nor a ``PackedSequence``.

    Unlike :class:`torch.nn.RNN`: ``nonlinearity`` defaults to ``"relu"``, ``weight_hh`` is a
    vector, and there is no ``bias_hh`` (it would add to ``bias_ih``). :attr:`all_weights` and
    :meth:`flatten_parameters` are there for code written for nn.RNN.
    """

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, nonlinearity: str = "relu",
                 bias: bool = True, batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False,
                 recurrent_max_abs: float | None = None, *, device=None, dtype=None, mesh=None,
                 partition_spec=None):
        super().__init__()
        if mesh is not None and partition_spec is not None and len(partition_spec) != 3:
            raise ValueError(f"partition_spec must describe the 3-D input, got {partition_spec!r}")
        # _sharding: of the time-major sequence the kernels see
        self.mesh, self.partition_spec, self._sharding = _module_sharding(
            mesh, partition_spec, (1, 0, 2) if batch_first else None)
        self.input_size = _check_positive_int(input_size, "input_size")
        self.hidden_size = _check_positive_int(hidden_size, "hidden_size")
        self.num_layers = _check_positive_int(num_layers, "num_layers")
        check_nonlinearity(nonlinearity)
        self.dropout = _checks.check_probability(dropout, "dropout")
        if self.dropout > 0 and self.num_layers == 1:
            _checks.warn("dropout acts between layers; with num_layers=1 it does nothing", stacklevel=2)
        if recurrent_max_abs is not None and not (isinstance(recurrent_max_abs, numbers.Real)
                                                  and recurrent_max_abs > 0 and math.isfinite(recurrent_max_abs)):
            raise ValueError(f"recurrent_max_abs must be None or a positive finite number, got {recurrent_max_abs!r}")
        self.nonlinearity = nonlinearity
        self.bias = bool(bias)
        self.batch_first = bool(batch_first)
        self.bidirectional = bool(bidirectional)
        self.recurrent_max_abs = None if recurrent_max_abs is None else float(recurrent_max_abs)
        factory = {"device": device, "dtype": dtype}
        for layer in range(self.num_layers):
            layer_input = self.input_size if layer == 0 else self.hidden_size * self.num_directions
            for suffix in self._suffixes(layer):
                self.register_parameter(f"weight_ih{suffix}", torch.nn.Parameter(
                    torch.empty(self.hidden_size, layer_input, **factory)))
                self.register_parameter(f"bias_ih{suffix}", torch.nn.Parameter(
                    torch.empty(self.hidden_size, **factory)) if self.bias else None)
                self.register_parameter(f"weight_hh{suffix}", torch.nn.Parameter(
                    torch.empty(self.hidden_size, **factory)))
        self.reset_parameters()

    @property
    def num_directions(self) -> int:
        return 2 if self.bidirectional else 1

    @property
    def _all_weights(self) -> list[list[str]]:
        # nn.RNN's attribute of the same name, which code written for nn.RNN reads; derived
        # rather than stored so that modules pickled before it existed still have it.
        names = ["weight_ih", "weight_hh"] + (["bias_ih"] if self.bias else [])
        return [[f"{name}{suffix}" for name in names]
                for layer in range(self.num_layers) for suffix in self._suffixes(layer)]

    @property
    def all_weights(self) -> list[list[torch.nn.Parameter]]:
        """The parameters of every layer and direction, as :attr:`torch.nn.RNN.all_weights`
        lists them: ``[weight_ih, weight_hh, bias_ih]`` per layer (and its ``_reverse``
        direction after it), without ``bias_ih`` when ``bias=False``."""
        return [[getattr(self, name) for name in names] for names in self._all_weights]

    def flatten_parameters(self) -> None:
        """Does nothing: the parameters need no flat buffer (nn.RNN packs its own for cuDNN).
        Kept so that code written for :class:`torch.nn.RNN` runs."""

    def _suffixes(self, layer: int) -> list[str]:
        return [f"_l{layer}"] + ([f"_l{layer}_reverse"] if self.bidirectional else [])

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.hidden_size)
        with torch.no_grad():
            for name, parameter in self.named_parameters():
                if name.startswith("weight_hh"):
                    parameter.uniform_(0.0, 1.0)
                else:
                    parameter.uniform_(-bound, bound)
        self.clip_recurrent_weights()

    def recurrent_weights(self) -> list[torch.nn.Parameter]:
        """The per-unit recurrent weights ``weight_hh_*`` of every layer and direction."""
        return [parameter for name, parameter in self.named_parameters() if name.startswith("weight_hh")]

    @torch.no_grad()
    def clip_recurrent_weights(self) -> None:
        """Clamps every recurrent weight to ``[-recurrent_max_abs, recurrent_max_abs]``
        (nothing if it is ``None``). Call it after each optimizer step."""
        if self.recurrent_max_abs is not None:
            for weight in self.recurrent_weights():
                weight.clamp_(-self.recurrent_max_abs, self.recurrent_max_abs)

    def clip_after(self, optimizer: torch.optim.Optimizer):
        """Registers :meth:`clip_recurrent_weights` to run after every ``optimizer.step()``.

        Returns:
            The hook's handle (``handle.remove()`` undoes it).
        """
        return optimizer.register_step_post_hook(lambda *_: self.clip_recurrent_weights())

    def forward(self, input, hx: torch.Tensor | None = None):
        packed = isinstance(input, PackedSequence)
        if packed:
            # Run in the packed batch's sorted order, as nn.RNN does; the kernels stop each
            # sequence at its length.
            packing = Padded(input)
            input, lengths = packing.padded(), packing.lengths
            if hx is not None and isinstance(hx, torch.Tensor) and packing.sorted_indices is not None:
                hx = hx.index_select(1, packing.sorted_indices.to(hx.device))
        elif not isinstance(input, torch.Tensor):
            raise TypeError(f"input must be a torch.Tensor or a PackedSequence, got {type(input).__name__}")
        else:
            lengths = None
        parameter_device = self.weight_ih_l0.device
        for name, tensor in (("input", input), ("hx", hx)):
            if isinstance(tensor, torch.Tensor) and tensor.device != parameter_device:
                raise ValueError(f"{name} is on {tensor.device} but the module's parameters are on "
                                 f"{parameter_device}: move both to the same device (module.to(device))")
        self._check_dtypes(input, hx)
        batched = input.dim() == 3
        if input.dim() not in (2, 3):
            raise ValueError(f"input must be 2-D (unbatched) or 3-D, got shape {tuple(input.shape)}")
        if input.shape[-1] != self.input_size:
            raise _RNNInputError(f"input must have {self.input_size} features, got shape {tuple(input.shape)}")
        if input.shape[0 if packed or not (batched and self.batch_first) else 1] == 0:
            # as nn.RNN ("Expected sequence length to be larger than 0"); a batch of 0 it accepts
            raise _RNNInputError(f"input must have at least one time step, got shape {tuple(input.shape)}"
                                 f"{' (batch_first)' if batched and self.batch_first else ''}")
        sequence = input if batched else input.unsqueeze(1)
        if batched and self.batch_first and not packed:
            sequence = sequence.transpose(0, 1)
        batch = sequence.shape[1]
        states = self.num_layers * self.num_directions
        if hx is not None:
            expected = (states, batch, self.hidden_size) if batched else (states, self.hidden_size)
            if not isinstance(hx, torch.Tensor) or hx.shape != expected:
                raise _RNNInputError(f"hx must have shape {expected}, got "
                                 f"{tuple(hx.shape) if isinstance(hx, torch.Tensor) else type(hx).__name__}")
            if not batched:
                hx = hx.unsqueeze(1)
        if lengths is not None:
            lengths = _checks.check_lengths(lengths, parameter_device, sequence.shape[0], batch)
        if self.mesh is not None and (packed or not batched):
            raise ValueError("a module with a partition_spec takes a padded, batched input "
                             "(a PackedSequence or an unbatched input cannot be split by it)")

        last_states = []
        for layer in range(self.num_layers):
            directions = []
            for direction, suffix in enumerate(self._suffixes(layer)):
                projected = torch.nn.functional.linear(
                    sequence, getattr(self, f"weight_ih{suffix}"), getattr(self, f"bias_ih{suffix}"))
                if direction == 1:
                    projected = reverse_each(projected, lengths)
                h0 = None if hx is None else hx[layer * self.num_directions + direction]
                output, h_n = _indrnn(projected, getattr(self, f"weight_hh{suffix}"), h0, self.nonlinearity, False,
                                      lengths, self._sharding)
                directions.append(reverse_each(output, lengths) if direction == 1 else output)
                last_states.append(h_n)
            sequence = directions[0] if len(directions) == 1 else torch.cat(directions, dim=-1)
            if self.dropout > 0 and self.training and layer < self.num_layers - 1:
                sequence = _dropout(sequence, self.dropout, True, False, None, None, None, True, self._sharding)

        h_n = torch.stack(last_states)
        if packed:
            if packing.unsorted_indices is not None:
                h_n = h_n.index_select(1, packing.unsorted_indices.to(h_n.device))
            return packing.packed(sequence), h_n
        if not batched:
            return sequence.squeeze(1), h_n.squeeze(1)
        return (sequence.transpose(0, 1) if self.batch_first else sequence), h_n

    def _check_dtypes(self, input: torch.Tensor, hx) -> None:
        """As nn.RNN: the input's dtype must be the parameters' unless autocast is on (which
        casts the projection); hx's too (nn.RNN fails on it in a matmul, with RuntimeError).
        Integer inputs (token ids: embed them first) never pass, autocast or not."""
        expected = self.weight_ih_l0.dtype
        autocast = torch._C._is_any_autocast_enabled()
        if not input.is_floating_point() or (input.dtype != expected and not autocast):
            raise _RNNInputError(f"input must have the type {expected}, got type {input.dtype}"
                                 + (" (token ids? embed them first)" if not input.is_floating_point() else ""))
        if isinstance(hx, torch.Tensor) and (not hx.is_floating_point() or (hx.dtype != expected and not autocast)):
            raise _RNNInputError(f"hx must have the type {expected}, got type {hx.dtype}")

    def extra_repr(self) -> str:
        text = f"{self.input_size}, {self.hidden_size}"
        defaults = {"num_layers": 1, "nonlinearity": "relu", "bias": True, "batch_first": False, "dropout": 0.0,
                    "bidirectional": False, "recurrent_max_abs": None, "partition_spec": None}
        for name, default in defaults.items():
            if getattr(self, name) != default:
                text += f", {name}={getattr(self, name)!r}"
        return text

