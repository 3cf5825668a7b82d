"""Modules: :class:`Dropout` (a drop-in :class:`torch.nn.Dropout`), :func:`convert_dropout`, :class:`IndRNN`."""

from __future__ import annotations

import logging
import math
import numbers
import warnings

import torch

from torch_pallas import _checks
from torch_pallas.functional import dropout as dropout_fn, indrnn
from torch_pallas.kernels.indrnn import check_nonlinearity

__all__ = ["Dropout", "IndRNN", "convert_dropout"]

_logger = logging.getLogger("torch_pallas")


class Dropout(torch.nn.Dropout):
    r"""During training, zeroes elements with probability ``p`` and scales the rest by :math:`1/(1-p)`.

    A drop-in for :class:`torch.nn.Dropout` (a subclass of it, with its signature and repr)
    on XLA devices: each call draws a fresh key from the XLA RNG (reproducible after
    ``torch_xla.manual_seed``), and the backward pass regenerates the mask from that 8-byte
    key instead of storing it. In ``eval()`` mode it returns its input, whatever its device
    and dtype. See :func:`torch_pallas.dropout`.

    Args:
        p (float): probability of an element being zeroed, in :math:`[0, 1]`. Default: 0.5.
        inplace (bool): write the result into the input and return it, as
            :class:`torch.nn.Dropout` does. Default: ``False``.
        impl (str, optional): ``"threefry"`` or ``"hardware"`` (TPU only); default per platform.

    Shape:
        - Input: any shape; in training mode float32, bfloat16 or float16 on an XLA device.
        - Output: the input's shape and dtype.

    Raises:
        TypeError: ``p`` is not a real number.
        ValueError: ``p`` outside :math:`[0, 1]` or NaN, an unknown ``impl``, or
            ``impl="hardware"`` off TPU.
    """

    def __init__(self, p: float = 0.5, inplace: bool = False, *, impl=None):
        super().__init__(_checks.check_probability(p), inplace)
        _checks.resolve_impl(impl)
        self.impl = impl

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return input
        output = dropout_fn(input, self.p, impl=self.impl)
        return input.copy_(output) if self.inplace and output is not input else output

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", impl={self.impl!r}" if self.impl is not None else "")


def convert_dropout(model: torch.nn.Module, *, impl=None) -> torch.nn.Module:
    """Replaces every :class:`torch.nn.Dropout` in ``model`` (nested too) with :class:`Dropout`.

    Each replacement keeps the original's ``p``, ``inplace`` and training mode.
    ``Dropout1d/2d/3d`` and ``AlphaDropout`` (different semantics) are left alone, as are
    other subclasses of ``nn.Dropout``. Dropout that is not a module (``F.dropout`` calls
    in ``forward``, as in OPT or Llama) is out of this function's reach: run the model
    inside :func:`torch_pallas.route_dropout` to reach it. The ``torch_pallas`` logger
    says what was converted, and a warning says so when nothing was.

    Args:
        model (nn.Module): converted in place.
        impl (str, optional): passed to every new :class:`Dropout`.

    Returns:
        nn.Module: ``model``, or a new :class:`Dropout` if ``model`` itself is an ``nn.Dropout``.
    """
    _checks.resolve_impl(impl)
    if type(model) is torch.nn.Dropout:
        return _replacement(model, impl)
    converted = []
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Dropout:
                setattr(parent, name, _replacement(child, impl))
                converted.append(f"{parent_name}.{name}" if parent_name else name)
    _logger.info("convert_dropout: converted %d nn.Dropout modules: %s", len(converted), ", ".join(converted))
    if not converted:
        warnings.warn(f"convert_dropout found no nn.Dropout module in {type(model).__name__}; if its forward "
                      "calls F.dropout, run it inside torch_pallas.route_dropout()", stacklevel=2)
    return model


def _replacement(module: torch.nn.Dropout, impl) -> Dropout:
    replacement = Dropout(module.p, module.inplace, impl=impl)
    replacement.train(module.training)
    return replacement


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

    Parameters (for layer ``k``; ``_reverse`` suffix for the backward direction):
        weight_ih_l{k}: ``(hidden_size, input_size)`` for ``k = 0``, else
            ``(hidden_size, num_directions * hidden_size)``; uniform in
            :math:`(-1/\sqrt{hidden}, 1/\sqrt{hidden})`, as in :class:`torch.nn.RNN`.
        bias_ih_l{k}: ``(hidden_size,)``, initialised like ``weight_ih``.
        weight_hh_l{k}: ``(hidden_size,)`` recurrent weights, uniform in :math:`(0, 1)` as in
            the IndRNN paper (clipped to ``recurrent_max_abs`` when given).

    Inputs: ``input, hx``
        input: ``(T, B, input_size)``, ``(B, T, input_size)`` with ``batch_first``, or
            ``(T, input_size)`` unbatched; float, on an XLA device.
        hx: ``(num_layers * num_directions, B, hidden_size)`` (no ``B`` if unbatched); zeros
            if omitted.

    Outputs: ``output, h_n``
        output: ``(T, B, num_directions * hidden_size)`` (batch first if ``batch_first``).
        h_n: ``(num_layers * num_directions, B, hidden_size)``, the last state of every layer
            and direction (the state after the first time step for the reverse direction).

    Raises:
        ValueError: bad sizes, ``nonlinearity``, ``dropout`` or ``recurrent_max_abs`` at
            construction; input or ``hx`` of the wrong rank or size in :meth:`forward`.
    """

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, nonlinearity: str = "relu",
                 bias: bool = True, batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False,
                 recurrent_max_abs: float | None = None, *, device=None, dtype=None):
        super().__init__()
        self.input_size = _check_positive_int(input_size, "input_size")
        self.hidden_size = _check_positive_int(hidden_size, "hidden_size")
        self.num_layers = _check_positive_int(num_layers, "num_layers")
        check_nonlinearity(nonlinearity)
        self.dropout = _checks.check_probability(dropout, "dropout")
        if self.dropout > 0 and self.num_layers == 1:
            warnings.warn("dropout acts between layers; with num_layers=1 it does nothing", stacklevel=2)
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

    def forward(self, input: torch.Tensor, hx: torch.Tensor | None = None):
        if isinstance(input, torch.nn.utils.rnn.PackedSequence):
            raise TypeError("IndRNN does not take a PackedSequence yet: pad it "
                            "(torch.nn.utils.rnn.pad_packed_sequence) and pass the padded tensor")
        if not isinstance(input, torch.Tensor):
            raise TypeError(f"input must be a torch.Tensor, got {type(input).__name__}")
        parameter_device = self.weight_ih_l0.device
        for name, tensor in (("input", input), ("hx", hx)):
            if tensor is not None and tensor.device != parameter_device:
                raise ValueError(f"{name} is on {tensor.device} but the module's parameters are on "
                                 f"{parameter_device}: move both to the same XLA device (module.to(device))")
        batched = input.dim() == 3
        if input.dim() not in (2, 3):
            raise ValueError(f"input must be 2-D (unbatched) or 3-D, got shape {tuple(input.shape)}")
        if input.shape[-1] != self.input_size:
            raise ValueError(f"input must have {self.input_size} features, got shape {tuple(input.shape)}")
        sequence = input if batched else input.unsqueeze(1)
        if batched and self.batch_first:
            sequence = sequence.transpose(0, 1)
        batch = sequence.shape[1]
        states = self.num_layers * self.num_directions
        if hx is not None:
            expected = (states, batch, self.hidden_size) if batched else (states, self.hidden_size)
            if not isinstance(hx, torch.Tensor) or hx.shape != expected:
                raise ValueError(f"hx must have shape {expected}, got "
                                 f"{tuple(hx.shape) if isinstance(hx, torch.Tensor) else type(hx).__name__}")
            if not batched:
                hx = hx.unsqueeze(1)

        last_states = []
        for layer in range(self.num_layers):
            directions = []
            for direction, suffix in enumerate(self._suffixes(layer)):
                projected = torch.nn.functional.linear(
                    sequence, getattr(self, f"weight_ih{suffix}"), getattr(self, f"bias_ih{suffix}"))
                if direction == 1:
                    projected = projected.flip(0)
                h0 = None if hx is None else hx[layer * self.num_directions + direction]
                output, h_n = indrnn(projected, getattr(self, f"weight_hh{suffix}"), h0,
                                     nonlinearity=self.nonlinearity)
                directions.append(output.flip(0) if direction == 1 else output)
                last_states.append(h_n)
            sequence = directions[0] if len(directions) == 1 else torch.cat(directions, dim=-1)
            if self.dropout > 0 and self.training and layer < self.num_layers - 1:
                sequence = dropout_fn(sequence, self.dropout, shared_over_first_dim=True)

        h_n = torch.stack(last_states)
        if not batched:
            return sequence.squeeze(1), h_n.squeeze(1)
        return (sequence.transpose(0, 1) if self.batch_first else sequence), h_n

    def extra_repr(self) -> str:
        text = f"{self.input_size}, {self.hidden_size}"
        defaults = {"num_layers": 1, "nonlinearity": "relu", "bias": True, "batch_first": False, "dropout": 0.0,
                    "bidirectional": False, "recurrent_max_abs": None}
        for name, default in defaults.items():
            if getattr(self, name) != default:
                text += f", {name}={getattr(self, name)!r}"
        return text
