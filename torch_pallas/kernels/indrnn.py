"""IndRNN recurrence as Pallas kernels (pure JAX; no torch here).

The independently recurrent neural network (IndRNN) updates every feature on its
own::

    h_t = act(x_t + w * h_{t-1}),    act in {relu, tanh},  w of shape (F,)

so the recurrence is elementwise: a kernel instance owning a (batch, feature) tile
can run the whole time loop without talking to any other instance. The layout is
time-major, ``x`` of shape ``(T, B, F)``; the torch layer above handles
``batch_first`` by transposing.

Kernels
-------
Both kernels use the grid ``(batch blocks, feature blocks, time blocks)``. Time is
the last grid axis and is sequential ("arbitrary"); batch and feature blocks are
independent ("parallel", so megacore TPUs may split them). The recurrent state
lives in a float32 VMEM scratch of shape ``(block_b, block_f)`` that survives from
one time block to the next, so any ``T`` works with pipelined copies and, on TPU,
no block holds the whole sequence unless ``T`` is small. Within a block a
``fori_loop`` walks the time steps. State and accumulations are float32 for every
input dtype.

* ``indrnn_forward`` reads ``x`` once and writes ``output`` once:
  ``2 * T*B*F * itemsize`` bytes, plus ``h0``/``h_n`` (``B*F`` each) and the weight
  row once per (batch block, time block).
* ``indrnn_backward`` runs time in reverse and needs only the saved outputs (the
  derivative of relu is ``h_t > 0``, of tanh ``1 - h_t**2``; no pre-activations are
  stored). It reads ``grad_output`` and ``output`` once and writes ``grad_x`` once:
  ``3 * T*B*F * itemsize`` bytes. The step at the start of a time block needs
  ``h_{t-1}`` from the previous block; a second BlockSpec view of ``output`` with a
  one-step time extent fetches just that row, adding ``B*F * itemsize`` per time
  block (a ``1/block_t`` fraction of one sequence read) instead of a second copy of
  the sequence. Add ``h0``, ``grad_h_n``, ``grad_h0`` (``B*F`` each) and the float32
  weight-gradient partials (``4*B*F``).

Ragged shapes
-------------
Grids are ``cdiv(shape, block)``, so Pallas pads edge blocks. Padded batch rows and
feature columns compute on garbage that is never written back and never reduced
(the weight gradient is kept per batch row, see below). Padded *time* steps are
never executed: the number of valid steps in the last time block is a static
Python int, and that block runs a loop of exactly that length, so ``h_n`` and the
backward carry never see padding.

Variable lengths
----------------
An optional int32 ``lengths`` of shape ``(B,)`` (as a packed batch of sequences has) stops
each row at its own length: at steps ``t >= lengths[b]`` the state is held, the output is
0 and nothing flows back, so ``h_n`` is each row's last valid state. The lengths are data
travelling in a ``(block_b, 1)`` block, not static values: one compiled kernel serves every
set of lengths. Without them the kernels carry no mask at all.

Determinism
-----------
The weight gradient is accumulated per batch row in a float32 output block of
shape ``(block_b, block_f)`` that stays resident across the time axis. The kernel
never reduces across rows (no atomics, no cross-instance races); the rows are
summed afterwards by ``jnp.sum`` in a fixed order outside the kernel.

Blocks
------
:class:`tiling.RecurrenceBlocks` ``(time, batch, features, unroll)``, resolved by
:func:`tiling.resolve_recurrence` (defaults, and Mosaic's rule for batch and features on
every platform). ``time`` is free.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torch_pallas.kernels import arguments, calls, tiling

__all__ = ["NONLINEARITIES", "check_nonlinearity", "indrnn_forward", "indrnn_backward"]

NONLINEARITIES = ("relu", "tanh")


def check_nonlinearity(nonlinearity: str) -> str:
    return arguments.check_one_of("nonlinearity", nonlinearity, NONLINEARITIES)


def _activate(pre_activation: jax.Array, nonlinearity: str) -> jax.Array:
    if nonlinearity == "relu":
        return jnp.maximum(pre_activation, 0.0)
    return jnp.tanh(pre_activation)


def _activation_derivative_from_output(hidden: jax.Array, nonlinearity: str) -> jax.Array:
    """act'(a_t) written in terms of h_t = act(a_t), so no pre-activation is saved."""
    if nonlinearity == "relu":
        return (hidden > 0.0).astype(jnp.float32)
    return 1.0 - hidden * hidden


def _check_float(name: str, array) -> None:
    if not jnp.issubdtype(array.dtype, jnp.floating):
        raise ValueError(f"{name} must be a floating-point array, got dtype {array.dtype}")


def _check_shapes(x, weight, h0, x_name: str = "x") -> tuple[int, int, int]:
    if x.ndim != 3:
        raise ValueError(f"{x_name} must have shape (T, B, F), got {x.shape}")
    T, B, F = x.shape
    if weight.shape != (F,):
        raise ValueError(f"weight must have shape ({F},) to match {x_name} {x.shape}, got {weight.shape}")
    if h0.shape != (B, F):
        raise ValueError(f"h0 must have shape ({B}, {F}) to match {x_name} {x.shape}, got {h0.shape}")
    for name, array in ((x_name, x), ("weight", weight), ("h0", h0)):
        _check_float(name, array)
    return T, B, F


def _check_lengths(lengths, batch: int):
    """``lengths`` as the kernels take it: int32 of shape (B, 1), or None."""
    if lengths is None:
        return None
    if lengths.shape != (batch,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"lengths must be an integer array of shape ({batch},), got {lengths.dtype} {lengths.shape}")
    return lengths.astype(jnp.int32).reshape(batch, 1)


def _compiler_params():
    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))


def _unrolled_loop(num_steps: int, body, carry, unroll: int):
    """``fori_loop(0, num_steps, body, carry)`` unrolled ``unroll`` times by hand.

    Mosaic lowers ``fori_loop`` only fully unrolled or not at all, so partial
    unrolling is spelt out: a loop over groups of ``unroll`` steps followed by the
    static remainder.
    """
    num_groups, remainder = divmod(num_steps, unroll)

    def group(group_index, carry):
        first = group_index * unroll
        for k in range(unroll):
            carry = body(first + k, carry)
        return carry

    if num_groups == 1:
        carry = group(0, carry)
    elif num_groups > 1:
        carry = lax.fori_loop(0, num_groups, group, carry)
    for k in range(remainder):
        carry = body(num_groups * unroll + k, carry)
    return carry


# --------------------------------------------------------------------------- forward


def _load_weight(weight_ref, state_shape, interpret: bool) -> jax.Array:
    weight = weight_ref[...].astype(jnp.float32)
    if interpret:
        # Left as a (1, F) row, the broadcast fuses into each step's XLA loop; a
        # materialised (B, F) copy is extra memory traffic on every step.
        return weight
    # On TPU a sublane broadcast per step is wasted work: do it once per block.
    return jnp.broadcast_to(weight, state_shape)


def _valid_steps(lengths_ref, time_block, block_t: int):
    """``valid(i)``: the (block_b, 1) rows still running at step i of this time block, or
    ``None`` when every row runs every step (no lengths)."""
    if lengths_ref is None:
        return None
    lengths = lengths_ref[...]
    return lambda i: time_block * block_t + i < lengths


def _forward_kernel(
    *refs, nonlinearity: str, num_time_blocks: int, block_t: int, last_block_steps: int, unroll: int,
    interpret: bool, has_lengths: bool,
):
    if has_lengths:
        x_ref, weight_ref, h0_ref, lengths_ref, out_ref, h_n_ref, state_ref = refs
    else:
        (x_ref, weight_ref, h0_ref, out_ref, h_n_ref, state_ref), lengths_ref = refs, None
    time_block = pl.program_id(2)
    valid = _valid_steps(lengths_ref, time_block, block_t)

    @pl.when(time_block == 0)
    def _():
        state_ref[...] = h0_ref[...].astype(jnp.float32)

    weight = _load_weight(weight_ref, state_ref.shape, interpret)

    def run_steps(num_steps: int):
        def step(i, hidden):
            updated = _activate(x_ref[i].astype(jnp.float32) + weight * hidden, nonlinearity)
            if valid is None:
                out_ref[i] = updated.astype(out_ref.dtype)
                return updated
            running = valid(i)
            out_ref[i] = jnp.where(running, updated, 0.0).astype(out_ref.dtype)
            return jnp.where(running, updated, hidden)

        state_ref[...] = _unrolled_loop(num_steps, step, state_ref[...], unroll)

    # The last time block may be ragged; its step count is static, so padded steps
    # are simply never run (no masking inside the loop).
    if last_block_steps == block_t:
        run_steps(block_t)
    else:
        pl.when(time_block < num_time_blocks - 1)(lambda: run_steps(block_t))
        pl.when(time_block == num_time_blocks - 1)(lambda: run_steps(last_block_steps))

    @pl.when(time_block == num_time_blocks - 1)
    def _():
        h_n_ref[...] = state_ref[...].astype(h_n_ref.dtype)


def indrnn_forward(
    x: jax.Array,
    weight: jax.Array,
    h0: jax.Array,
    lengths: jax.Array | None = None,
    *,
    nonlinearity: str,
    interpret: bool,
    blocks: tiling.RecurrenceBlocks | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Run ``h_t = act(x_t + weight * h_{t-1})`` over a time-major sequence.

    Args:
      x: input of shape ``(T, B, F)``, float32, bfloat16 or float16.
      weight: recurrent weight of shape ``(F,)``, any float dtype.
      h0: initial state of shape ``(B, F)``, any float dtype.
      lengths: optional steps to run per row, integer of shape ``(B,)``: row b runs steps
        ``t < lengths[b]``, its output is 0 after them and ``h_n[b]`` is its last state
        (``h0[b]`` for a length of 0 or less). Data, not static: no recompilation per value.
      nonlinearity: ``"relu"`` or ``"tanh"``.
      interpret: run Pallas in interpret mode (CPU) instead of compiling for TPU.
      blocks: optional blocks overriding the default (see
        :func:`tiling.resolve_recurrence`). Any valid blocks give the same result.

    Returns:
      ``(output, h_n)``: all hidden states, shape ``(T, B, F)``, and the last one,
      shape ``(B, F)``, both in ``x.dtype``. The state is carried in float32.

    Raises:
      ValueError: for an unknown ``nonlinearity``, mismatched shapes, non-float
        dtypes, or invalid ``blocks``.
    """
    check_nonlinearity(nonlinearity)
    T, B, F = _check_shapes(x, weight, h0)
    lengths = _check_lengths(lengths, B)
    if T == 0 or B == 0 or F == 0:
        return jnp.zeros(x.shape, x.dtype), h0.astype(x.dtype)
    wide = tiling.widen_float16(x, weight, h0)
    blocks = tiling.resolve_recurrence(blocks, T, B, F, wide[0].dtype, interpret=interpret)
    output, h_n = _forward_call(*wide, lengths, nonlinearity=nonlinearity, interpret=interpret, blocks=blocks)
    return output.astype(x.dtype), h_n.astype(x.dtype)


class _RecurrenceGrid(NamedTuple):
    """What the forward and backward kernels share: the (batch block, feature block, time
    block) grid, the block specs, and the static options both kernels take."""
    grid: tuple[int, int, int]
    time_block_of: Callable
    sequence_spec: pl.BlockSpec
    state_spec: pl.BlockSpec
    weight_spec: pl.BlockSpec
    lengths_spec: pl.BlockSpec
    kernel_options: dict


def _recurrence_grid(shape, blocks: tiling.RecurrenceBlocks, *, reverse_time: bool) -> _RecurrenceGrid:
    """``reverse_time`` maps grid step t to time block ``num_time_blocks - 1 - t`` (backward)."""
    T, B, F = shape
    num_time_blocks = pl.cdiv(T, blocks.time)

    def time_block_of(t):
        return num_time_blocks - 1 - t if reverse_time else t

    return _RecurrenceGrid(
        grid=(pl.cdiv(B, blocks.batch), pl.cdiv(F, blocks.features), num_time_blocks),
        time_block_of=time_block_of,
        sequence_spec=pl.BlockSpec((blocks.time, blocks.batch, blocks.features),
                                   lambda b, f, t: (time_block_of(t), b, f)),
        state_spec=pl.BlockSpec((blocks.batch, blocks.features), lambda b, f, t: (b, f)),
        # Mosaic has no good layout for 1-D blocks: the weight travels as a (1, F) row.
        weight_spec=pl.BlockSpec((1, blocks.features), lambda b, f, t: (0, f)),
        lengths_spec=pl.BlockSpec((blocks.batch, 1), lambda b, f, t: (b, 0)),
        kernel_options=dict(num_time_blocks=num_time_blocks, block_t=blocks.time, unroll=blocks.unroll,
                            last_block_steps=T - (num_time_blocks - 1) * blocks.time),
    )


# Jitted so that eager calls with the same shapes and options reuse one compile.
@functools.partial(jax.jit, static_argnames=("nonlinearity", "interpret", "blocks"))
def _forward_call(x, weight, h0, lengths, *, nonlinearity: str, interpret: bool,
                  blocks: tiling.RecurrenceBlocks):
    T, B, F = x.shape
    specs = _recurrence_grid(x.shape, blocks, reverse_time=False)
    kernel = functools.partial(_forward_kernel, nonlinearity=nonlinearity, interpret=interpret,
                               has_lengths=lengths is not None, **specs.kernel_options)
    optional = [] if lengths is None else [lengths]
    out_shape = (jax.ShapeDtypeStruct((T, B, F), x.dtype), jax.ShapeDtypeStruct((B, F), x.dtype))
    return calls.pallas_call(
        kernel,
        name=calls.kernel_name("indrnn", "fwd", nonlinearity, blocks=(blocks.time, blocks.batch, blocks.features)),
        # Per element: the weight's product, the input's add and the nonlinearity.
        cost_estimate=calls.cost_estimate(bytes_accessed=calls.nbytes(x, weight, h0, *optional, *out_shape),
                                          flops=3 * T * B * F,
                                          transcendentals=T * B * F if nonlinearity == "tanh" else 0),
        out_shape=out_shape,
        grid=specs.grid,
        in_specs=[specs.sequence_spec, specs.weight_spec, specs.state_spec] + [specs.lengths_spec] * len(optional),
        out_specs=(specs.sequence_spec, specs.state_spec),
        scratch_shapes=[pltpu.VMEM((blocks.batch, blocks.features), jnp.float32)],
        compiler_params=_compiler_params(),
        interpret=interpret,
    )(x, weight.reshape(1, F), h0, *optional)


# -------------------------------------------------------------------------- backward


def _backward_kernel(
    *refs, nonlinearity: str, num_time_blocks: int, block_t: int, last_block_steps: int, unroll: int,
    interpret: bool, has_lengths: bool,
):
    inputs, (grad_x_ref, grad_h0_ref, grad_weight_rows_ref, future_grad_ref) = refs[:-4], refs[-4:]
    grad_output_ref, grad_h_n_ref, output_ref, previous_row_ref, weight_ref, h0_ref = inputs[:6]
    lengths_ref = inputs[6] if has_lengths else None
    # Grid step 0 handles the LAST time block (the index maps reverse time).
    grid_step = pl.program_id(2)
    time_block = num_time_blocks - 1 - grid_step
    valid = _valid_steps(lengths_ref, time_block, block_t)

    # future_grad carries the part of dL/dh_t that comes from later steps:
    # w * dL/da_{t+1}, or grad_h_n for t = T-1.
    @pl.when(grid_step == 0)
    def _():
        future_grad_ref[...] = grad_h_n_ref[...].astype(jnp.float32)
        grad_weight_rows_ref[...] = jnp.zeros_like(grad_weight_rows_ref)

    weight = _load_weight(weight_ref, future_grad_ref.shape, interpret)

    def backprop_step(i, hidden_before, carry):
        future_grad, grad_weight_rows = carry
        hidden = output_ref[i].astype(jnp.float32)
        grad_pre_activation = (grad_output_ref[i].astype(jnp.float32) + future_grad) * (
            _activation_derivative_from_output(hidden, nonlinearity)
        )
        if valid is None:
            grad_x_ref[i] = grad_pre_activation.astype(grad_x_ref.dtype)
            return weight * grad_pre_activation, grad_weight_rows + grad_pre_activation * hidden_before
        # A finished row held its state: its gradient passes through unchanged.
        running = valid(i)
        grad_pre_activation = jnp.where(running, grad_pre_activation, 0.0)
        grad_x_ref[i] = grad_pre_activation.astype(grad_x_ref.dtype)
        return (jnp.where(running, weight * grad_pre_activation, future_grad),
                grad_weight_rows + grad_pre_activation * hidden_before)

    def block_start_hidden():
        # Step 0 needs the previous block's last state, or h0 for the first block.
        return jnp.where(
            time_block == 0,
            h0_ref[...].astype(jnp.float32),
            previous_row_ref[...].astype(jnp.float32),
        )

    def run_steps(num_steps: int):
        # Accumulating onto the running sum (not a per-block partial added at the
        # end) keeps the float32 summation order independent of block_t, so every
        # block shape gives bit-identical gradients.
        carry = (future_grad_ref[...], grad_weight_rows_ref[...])
        if interpret:
            # Every step, step 0 included, inside the one loop: a step 0 peeled off after
            # the loop becomes, in interpret mode, a dynamic-update-slice of grad_x outside
            # XLA's while loop, which XLA may not do in place (it copied the whole
            # (T, B, F) gradient for it when the result was also read elsewhere in the
            # graph). The select costs a (B, F) operation per step here, nothing else.
            boundary = block_start_hidden()

            def step(j, carry):
                i = num_steps - 1 - j
                hidden_before = jnp.where(i == 0, boundary,
                                          output_ref[jnp.maximum(i - 1, 0)].astype(jnp.float32))
                return backprop_step(i, hidden_before, carry)

            future_grad, grad_weight_rows = _unrolled_loop(num_steps, step, carry, unroll)
        else:
            # Steps num_steps-1 .. 1 find h_{i-1} in this block. Reading it again rather
            # than carrying it from the previous iteration is one copy fewer per step.
            def step(j, carry):
                i = num_steps - 1 - j
                return backprop_step(i, output_ref[i - 1].astype(jnp.float32), carry)

            carry = _unrolled_loop(num_steps - 1, step, carry, unroll)
            future_grad, grad_weight_rows = backprop_step(0, block_start_hidden(), carry)
        future_grad_ref[...] = future_grad
        grad_weight_rows_ref[...] = grad_weight_rows

    # Only the last time block (grid step 0) can be ragged; see the forward kernel.
    if last_block_steps == block_t:
        run_steps(block_t)
    else:
        pl.when(grid_step == 0)(lambda: run_steps(last_block_steps))
        pl.when(grid_step > 0)(lambda: run_steps(block_t))

    # After time step 0, future_grad = w * dL/da_0 = dL/dh0.
    @pl.when(grid_step == num_time_blocks - 1)
    def _():
        grad_h0_ref[...] = future_grad_ref[...].astype(grad_h0_ref.dtype)


def indrnn_backward(
    grad_output: jax.Array,
    grad_h_n: jax.Array,
    output: jax.Array,
    weight: jax.Array,
    h0: jax.Array,
    lengths: jax.Array | None = None,
    *,
    nonlinearity: str,
    interpret: bool,
    blocks: tiling.RecurrenceBlocks | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gradients of ``indrnn_forward`` from its saved outputs.

    With ``a_t = x_t + w * h_{t-1}`` and ``h_t = act(a_t)``, walking t from T-1 down:
    ``dL/dh_t = g_t + w * dL/da_{t+1}`` (plus ``grad_h_n`` at ``t = T-1``),
    ``dL/da_t = dL/dh_t * act'(a_t)`` with act' taken from ``h_t`` (relu: ``h_t > 0``;
    tanh: ``1 - h_t**2``). Then ``grad_x_t = dL/da_t``,
    ``grad_weight = sum_{t,b} dL/da_t * h_{t-1}`` (``h_{-1} = h0``) and
    ``grad_h0 = w * dL/da_0``.

    Args:
      grad_output: cotangent of ``output``, shape ``(T, B, F)``, in ``output.dtype``
        (other float dtypes are accepted and read as float32).
      grad_h_n: cotangent of ``h_n``, shape ``(B, F)``.
      output: the forward's ``output``, shape ``(T, B, F)``.
      weight: recurrent weight, shape ``(F,)``.
      h0: initial state, shape ``(B, F)``.
      lengths, nonlinearity, interpret, blocks: as for ``indrnn_forward``; use the same
        ``lengths`` and ``nonlinearity`` as the forward pass. Any valid time, batch and
        feature blocks give the same result; another ``unroll`` may change the last bits
        (float32 rounding: bench/results/interpret_choices.md, § Time-loop unroll).

    Returns:
      ``(grad_x, grad_weight, grad_h0)`` with shapes ``(T, B, F)``, ``(F,)``,
      ``(B, F)`` in ``output.dtype`` (the dtype of ``x``), ``weight.dtype`` and
      ``h0.dtype``. Accumulation is float32; the weight gradient is reduced over
      batch rows outside the kernel in a fixed order, so it is deterministic.

    Raises:
      ValueError: for an unknown ``nonlinearity``, mismatched shapes, non-float
        dtypes, or invalid ``blocks``.
    """
    check_nonlinearity(nonlinearity)
    T, B, F = _check_shapes(output, weight, h0, x_name="output")
    if grad_output.shape != output.shape:
        raise ValueError(f"grad_output must have shape {output.shape}, got {grad_output.shape}")
    if grad_h_n.shape != (B, F):
        raise ValueError(f"grad_h_n must have shape ({B}, {F}), got {grad_h_n.shape}")
    _check_float("grad_output", grad_output)
    _check_float("grad_h_n", grad_h_n)
    lengths = _check_lengths(lengths, B)
    if T == 0 or B == 0 or F == 0:
        return (
            jnp.zeros(output.shape, output.dtype),
            jnp.zeros(weight.shape, weight.dtype),
            grad_h_n.astype(h0.dtype) if T == 0 else jnp.zeros(h0.shape, h0.dtype),
        )
    wide = tiling.widen_float16(grad_output, grad_h_n, output, weight, h0)
    blocks = tiling.resolve_recurrence(blocks, T, B, F, wide[2].dtype, interpret=interpret)
    grad_x, grad_weight, grad_h0 = _backward_call(*wide, lengths, nonlinearity=nonlinearity, interpret=interpret,
                                                  blocks=blocks)
    return grad_x.astype(output.dtype), grad_weight.astype(weight.dtype), grad_h0.astype(h0.dtype)


@functools.partial(jax.jit, static_argnames=("nonlinearity", "interpret", "blocks"))
def indrnn_backward_weight_rows(*args, **options):
    """:func:`indrnn_backward` on one batch shard of a sharded batch, its weight gradient as a
    ``(1, F)`` row: the shards' rows are summed afterwards in a fixed order."""
    grad_x, grad_weight, grad_h0 = indrnn_backward(*args, **options)
    return grad_x, grad_weight[None], grad_h0


def _ignoring_input(kernel, index: int):
    """``kernel`` with one more input ref, at ``index``, that it never reads."""

    def kernel_with_ignored_input(*refs):
        return kernel(*refs[:index], *refs[index + 1:])

    return kernel_with_ignored_input


# Whether interpret mode hands the backward kernel a zero-filled grad_x buffer to write into
# (see _backward_call). Always on; a switch, read when the backward is traced, only so that
# bench/bench_interpret_choices.py can time the kernel without it.
_INTERPRET_ZEROED_GRAD_X = True


def _backward_call(grad_output, grad_h_n, output, weight, h0, lengths, *, nonlinearity: str, interpret: bool,
                   blocks: tiling.RecurrenceBlocks):
    T, B, F = output.shape
    specs = _recurrence_grid(output.shape, blocks, reverse_time=True)
    num_time_blocks = specs.kernel_options["num_time_blocks"]
    # One time step of `output`: h at the step before the block's first step. The
    # time extent is 1, so the block index is the step index. Time block 0 has no
    # such row (h0 is used there); its index is clamped to a harmless 0.
    previous_row_spec = pl.BlockSpec(
        (None, blocks.batch, blocks.features),
        lambda b, f, t: (jnp.maximum(specs.time_block_of(t) * blocks.time - 1, 0), b, f),
    )
    kernel = functools.partial(_backward_kernel, nonlinearity=nonlinearity, interpret=interpret,
                               has_lengths=lengths is not None, **specs.kernel_options)
    optional = [] if lengths is None else [lengths]
    inputs = [grad_output, grad_h_n, output, output, weight.reshape(1, F), h0, *optional]
    in_specs = [specs.sequence_spec, specs.state_spec, specs.sequence_spec, previous_row_spec,
                specs.weight_spec, specs.state_spec] + [specs.lengths_spec] * len(optional)
    aliases = {}
    if interpret and _INTERPRET_ZEROED_GRAD_X:
        # The interpreter starts each output as a NaN-filled array. XLA merges this one with
        # the forward output's identical fill, then copies the whole (T, B, F) array so that
        # both loops can update theirs in place: a read and a write more than a second fill.
        # A zero-filled buffer handed in as grad_x is a value of its own, so neither loop
        # needs a copy. The copy is small next to the interpreted loops' own cost, but it is
        # never needed (measured, and the copy counted in the compiled program, in
        # bench/results/interpret_choices.md, § Zero-filled grad_x buffer).
        aliases = {len(inputs): 0}
        kernel = _ignoring_input(kernel, len(inputs))
        inputs.append(jnp.zeros((T, B, F), output.dtype))
        in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
    out_shape = (jax.ShapeDtypeStruct((T, B, F), output.dtype), jax.ShapeDtypeStruct((B, F), h0.dtype),
                 jax.ShapeDtypeStruct((B, F), jnp.float32))
    # Each time block also reads the output's row before it (previous_row_spec).
    previous_rows = num_time_blocks * B * F * output.dtype.itemsize
    grad_x, grad_h0, grad_weight_rows = calls.pallas_call(
        kernel,
        name=calls.kernel_name("indrnn", "bwd", nonlinearity, blocks=(blocks.time, blocks.batch, blocks.features)),
        # Per element: the nonlinearity's derivative, the gradient's product and add, and the
        # weight gradient's product and sum.
        cost_estimate=calls.cost_estimate(
            bytes_accessed=calls.nbytes(grad_output, grad_h_n, output, weight, h0, *optional, *out_shape)
            + previous_rows,
            flops=6 * T * B * F),
        out_shape=out_shape,
        grid=specs.grid,
        in_specs=in_specs,
        out_specs=(specs.sequence_spec, specs.state_spec, specs.state_spec),
        input_output_aliases=aliases,
        scratch_shapes=[pltpu.VMEM((blocks.batch, blocks.features), jnp.float32)],
        compiler_params=_compiler_params(),
        interpret=interpret,
    )(*inputs)
    grad_weight = jnp.sum(grad_weight_rows, axis=0).astype(weight.dtype)
    return grad_x, grad_weight, grad_h0
