"""Recurrent modules: :class:`IndRNN`, with :class:`torch.nn.RNN`'s conventions."""

from __future__ import annotations

import math
import numbers

import torch
from torch.nn.utils.rnn import PackedSequence

from torch_pallas import _checks, bridge, dtensors, sharding
from torch_pallas.functional import dropout_under_sharding, indrnn, indrnn_under_sharding
from torch_pallas.kernels.arguments import check_positive_int
from torch_pallas.kernels.indrnn import check_nonlinearity
from torch_pallas.packing import Padded, reverse_each

__all__ = ["IndRNN"]


def _reversed(sequence, lengths):
    """Each sequence of time-major ``sequence`` reversed within its length: for a DTensor (no
    length; time is not split) each rank reverses its own, as torch's DTensors have no flip."""
    if bridge.is_dtensor(sequence):
        return dtensors.on_local_shards(lambda local: reverse_each(local, None), sequence.device_mesh,
                                        sequence.placements, [(sequence.placements, sequence.shape)], sequence)
    return reverse_each(sequence, lengths)


class _RNNInputError(ValueError, RuntimeError):
    """Bad input to :meth:`IndRNN.forward` where :class:`torch.nn.RNN` raises RuntimeError:
    a ValueError like every other argument error of torch_pallas, which code written for
    nn.RNN (``except RuntimeError``) still catches."""


class _RNNDtypeError(TypeError, _RNNInputError):
    """An input or ``hx`` of the wrong dtype: a TypeError like every dtype error of
    torch_pallas, and the ValueError (input) or RuntimeError (``hx``) nn.RNN raises."""


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
        mesh, partition_spec: in SPMD mode, how a padded batched input is sharded (in its own layout, batch
            first or not; time must not be split): every layer's recurrence and dropout then
            run on each device's shard, also under ``torch.compile``. Give both or neither.
        impl (str, optional): the dropout's noise generator, as :class:`torch_pallas.nn.Dropout`
            takes it (default :func:`torch_pallas.random.get_default_impl`, read at each call).

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
            of sequences of different lengths; float (:ref:`dtypes`), on a device torch_pallas
            runs on (:ref:`devices`). Build a packed batch on the CPU and move it with ``.to(device)``, or with
            :func:`torch_pallas.packing.pack_padded_sequence`: torch_xla 2.9's
            ``pack_padded_sequence`` / ``pack_sequence`` return wrong data for XLA tensors.
            Or a batched ``torch.distributed`` DTensor split along its batch (or replicated),
            with ``hx`` a DTensor split alike: each rank runs its sequences, the parameters'
            gradients summed over the ranks (:ref:`DTensors <dtensors>`).
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
        ValueError: bad sizes, ``nonlinearity``, ``dropout``, ``recurrent_max_abs`` or ``impl`` at
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
                 partition_spec=None, impl=None):
        super().__init__()
        _checks.resolve_impl(impl)
        self.impl = impl
        if mesh is not None and partition_spec is not None and len(partition_spec) != 3:
            raise ValueError(f"partition_spec must describe the 3-D input, got {partition_spec!r}")
        self.mesh, self.partition_spec = mesh, None if partition_spec is None else tuple(partition_spec)
        # Of the time-major sequence the kernels see, resolved when built (torch.compile
        # cannot trace torch_xla's mesh code).
        kernel_spec = self.partition_spec
        if kernel_spec is not None and batch_first:
            kernel_spec = (kernel_spec[1], kernel_spec[0], kernel_spec[2])
        self._sharding = sharding.resolve(None, mesh, kernel_spec)
        self.input_size = check_positive_int(input_size, "input_size")
        self.hidden_size = check_positive_int(hidden_size, "hidden_size")
        self.num_layers = check_positive_int(num_layers, "num_layers")
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
        """Runs every layer over ``input`` from ``hx``: the class's Inputs and Outputs."""
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
        sequence, hx, lengths = self.check_forward_args(input, hx, lengths, packed)
        batched = packed or input.dim() == 3
        distributed = bridge.is_dtensor(sequence)
        last_states = []
        for layer in range(self.num_layers):
            directions = []
            for direction, suffix in enumerate(self._suffixes(layer)):
                weight_ih, bias_ih, weight_hh = (getattr(self, f"{name}{suffix}")
                                                 for name in ("weight_ih", "bias_ih", "weight_hh"))
                if distributed:
                    weight_ih, weight_hh = (dtensors.replicated(weight, sequence) for weight in (weight_ih, weight_hh))
                    bias_ih = None if bias_ih is None else dtensors.replicated(bias_ih, sequence)
                    projected = dtensors.linear_of_shards(sequence, weight_ih, bias_ih)
                else:
                    projected = torch.nn.functional.linear(sequence, weight_ih, bias_ih)
                if direction == 1:
                    projected = _reversed(projected, lengths)
                h0 = None if hx is None else hx[layer * self.num_directions + direction]
                if distributed:
                    output, h_n = indrnn(projected, weight_hh, h0, nonlinearity=self.nonlinearity, lengths=lengths)
                else:
                    output, h_n = indrnn_under_sharding(projected, weight_hh, h0, nonlinearity=self.nonlinearity,
                                                        batch_first=False, lengths=lengths, sharding=self._sharding)
                directions.append(_reversed(output, lengths) if direction == 1 else output)
                last_states.append(h_n)
            sequence = directions[0] if len(directions) == 1 else torch.cat(directions, dim=-1)
            if self.dropout > 0 and self.training and layer < self.num_layers - 1:
                sequence = dropout_under_sharding(sequence, self.dropout, True, False, impl=self.impl,
                                                  shared_over_first_dim=True, sharding=self._sharding)

        h_n = torch.stack(last_states)
        if packed:
            if packing.unsorted_indices is not None:
                h_n = h_n.index_select(1, packing.unsorted_indices.to(h_n.device))
            return packing.packed(sequence), h_n
        if not batched:
            return sequence.squeeze(1), h_n.squeeze(1)
        return (sequence.transpose(0, 1) if self.batch_first else sequence), h_n

    def check_forward_args(self, input: torch.Tensor, hx, lengths, packed: bool):
        """Checks :meth:`forward`'s arguments as :meth:`torch.nn.RNNBase.check_forward_args`
        does, and returns them as the kernels take them: the time-major batched sequence, the
        batched ``hx`` (or ``None``) and the lengths (or ``None``)."""
        self.check_input(input, packed)
        batched = packed or input.dim() == 3
        sequence = input if batched else input.unsqueeze(1)
        if batched and self.batch_first and not packed:
            sequence = sequence.transpose(0, 1)
        batch = sequence.shape[1]
        if hx is not None:
            states = self.num_layers * self.num_directions
            self.check_hidden_size(hx, (states, batch, self.hidden_size) if batched else (states, self.hidden_size))
            if not batched:
                hx = hx.unsqueeze(1)
        if lengths is not None:
            lengths = _checks.check_lengths(lengths, input.device, sequence.shape[0], batch)
        if self.mesh is not None and (packed or not batched):
            raise ValueError("a module with a partition_spec takes a padded, batched input "
                             "(a PackedSequence or an unbatched input cannot be split by it)")
        if bridge.is_dtensor(sequence):
            self._check_dtensor_input(sequence, hx, batched)
        return sequence, hx, lengths

    def _check_dtensor_input(self, sequence, hx, batched: bool) -> None:
        """A DTensor input (time-major here): batched, replicated or split along its batch only
        (each rank runs its sequences), an ``hx`` that is a DTensor placed as its batch, and no
        SPMD ``partition_spec``."""
        dtensors.check_placements(sequence, "input")
        if self.mesh is not None:
            raise ValueError("a module with a partition_spec (torch_xla's SPMD) takes no DTensor input")
        for placement in sequence.placements:
            if (not batched or isinstance(placement, dtensors.Partial)
                    or (isinstance(placement, dtensors.Shard) and placement.dim % 3 != 1)):
                raise ValueError(f"a DTensor input must be batched, and split along its batch only or replicated, "
                                 f"got {placement} for the time-major {tuple(sequence.shape)}: redistribute it")
        state = tuple(dtensors.Shard(1) if isinstance(p, dtensors.Shard) else p for p in sequence.placements)
        if hx is not None and not (bridge.is_dtensor(hx) and tuple(hx.placements) == state):
            raise ValueError(f"with a DTensor input, hx must be a DTensor placed {list(state)} (split as the input's "
                             f"batch), got {getattr(hx, 'placements', type(hx).__name__)}")

    def check_input(self, input: torch.Tensor, packed: bool = False) -> None:
        """As :meth:`torch.nn.RNNBase.check_input`: the parameters' device and dtype (another
        float dtype under autocast), 2-D or 3-D, ``input_size`` features, a time step at least."""
        self._check_device(input, "input")
        self._check_dtype(input, "input")
        if input.dim() not in (2, 3):
            raise ValueError(f"input must be 2-D (unbatched) or 3-D, got shape {tuple(input.shape)}")
        if input.shape[-1] != self.input_size:
            raise _RNNInputError(f"input must have {self.input_size} features, got shape {tuple(input.shape)}")
        batch_first = input.dim() == 3 and self.batch_first and not packed
        if input.shape[1 if batch_first else 0] == 0:
            # as nn.RNN ("Expected sequence length to be larger than 0"); a batch of 0 it accepts
            raise _RNNInputError(f"input must have at least one time step, got shape {tuple(input.shape)}"
                                 f"{' (batch_first)' if batch_first else ''}")

    def check_hidden_size(self, hx, expected_size: tuple[int, ...]) -> None:
        """As :meth:`torch.nn.RNNBase.check_hidden_size`, with its device and dtype too."""
        if not isinstance(hx, torch.Tensor) or hx.shape != expected_size:
            raise _RNNInputError(f"hx must have shape {expected_size}, got "
                                 f"{tuple(hx.shape) if isinstance(hx, torch.Tensor) else type(hx).__name__}")
        self._check_device(hx, "hx")
        self._check_dtype(hx, "hx")

    def _check_device(self, tensor: torch.Tensor, name: str) -> None:
        device = self.weight_ih_l0.device
        if tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device} but the module's parameters are on {device}: move "
                             "both to the same device (module.to(device))")

    def _check_dtype(self, tensor: torch.Tensor, name: str) -> None:
        """As nn.RNN: the parameters' dtype unless autocast is on (which casts the
        projection); integer inputs (token ids: embed them first) never pass."""
        expected = self.weight_ih_l0.dtype
        if not tensor.is_floating_point() or (tensor.dtype != expected and not torch._C._is_any_autocast_enabled()):
            raise _RNNDtypeError(f"{name} must have the type {expected}, got type {tensor.dtype}"
                                 + (" (token ids? embed them first)" if not tensor.is_floating_point() else ""))

    def extra_repr(self) -> str:
        text = f"{self.input_size}, {self.hidden_size}"
        defaults = {"num_layers": 1, "nonlinearity": "relu", "bias": True, "batch_first": False, "dropout": 0.0,
                    "bidirectional": False, "recurrent_max_abs": None, "partition_spec": None, "impl": None}
        for name, default in defaults.items():
            if getattr(self, name) != default:
                text += f", {name}={getattr(self, name)!r}"
        return text

