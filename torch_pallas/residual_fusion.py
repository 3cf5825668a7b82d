"""Dropouts fused with what reads them, with the dropout's own key: residual adds
(``residual + dropout(x)``, written by models as two calls) run as
:func:`torch_pallas.dropout_add`, and, in lazy mode, eager attention's product of dropped
weights and values (``dropout(weights) @ value``) as :func:`torch_pallas.dropout_matmul`, with
the softmax before it when the weights are a remembered softmax of scores
(:func:`fused_matmul`), and the whole of it as
:func:`torch_pallas.scaled_dot_product_attention` when the scores are a remembered
``query @ key.transpose(-2, -1)``, scaled and masked (:func:`remembered_scores`); and a linear
layer reading a dropout's output (``F.linear(dropout(x), weight, bias)``: LoRA's
``lora_A(dropout(x))``, T5's ``wo(dropout(h))``) as :func:`torch_pallas.dropout_linear`
(:func:`fused_linear`): :func:`torch_pallas.route_dropout`'s fusions, each on by default. Attention
weights (:func:`is_attention_weights`) are known here too: their dropout draws the mask the
fused attention kernels draw, fused or not.

A Pallas kernel is a custom call XLA cannot fuse: the two calls write the dropout's output to
memory and read it back, a pass over the tensor that the fused kernel saves. How the add is
reached depends on how the step is traced:

- lazily (torch_xla's lazy tensors; torchax tensors inside a JAX trace), by
  ``route_dropout()``: a routed dropout's output carries its drawn key, and
  an add of that output and a tensor of its shape returns ``dropout_add`` of the same key.
  The dropout's own node is then dead: nothing reads it, so it is never compiled or run,
  and the autograd graph of the sum does not reach it. Eager CPU tensors are not fused:
  their dropout kernel has already run when the add is seen.
- under ``torch.compile``, by the ``"torch_pallas"`` backend: openxla's, with a pass over
  AOTAutograd's graphs rewriting ``add(dropout(x), residual)``. Dynamo could trace the
  mode's rewrite, but not its safety check (a tensor's version counter is data-dependent
  there), while in AOTAutograd's functional graph no in-place op can come between.
"""

from __future__ import annotations

import itertools
import numbers
from typing import NamedTuple

import torch
from torch.autograd import forward_ad

from torch_pallas import _checks, bridge, functional, sharding
from torch_pallas.kernels import dropout_matmul as dropout_matmul_kernels
from torch_pallas.ops import attention as attention_ops, dropout_matmul as dropout_matmul_ops

__all__ = ["BACKEND", "backend", "fuse_residual_dropouts"]

# torch.compile(backend=BACKEND): :func:`backend`, named in pyproject.toml's entry points.
BACKEND = "torch_pallas"

# The out-of-place and in-place adds route_dropout offers to fuse: ``a + b`` and ``a += b``
# reach a TorchFunctionMode as Tensor.add and Tensor.add_.
ADDS = (torch.add, torch.Tensor.add, torch.Tensor.add_)
# Their arguments (a plain function, as route_dropout's parsers).
_add_arguments = lambda input, other, *, alpha=1, out=None: (input, other, alpha, out)  # noqa: E731
_DRAWN = "_torch_pallas_drawn_dropout"
# Numbers the remembered dropouts in the order they ran: an add of two of them fuses the later
# one, the other being the earlier residual stream, which its own next readers keep live
# (T5's first layer adds its attention's dropout to the embeddings' dropout, which its layer
# norm also reads).
_draws = itertools.count()


def routed_dropout(x: torch.Tensor, p, training: bool, impl, x_sharding: sharding.Sharding | None = None, *,
                   fusing: bool = True) -> torch.Tensor:
    """``torch_pallas.dropout(x, p, training, impl=impl)`` as :func:`torch_pallas.route_dropout`
    runs it: the mask of attention weights (:func:`is_attention_weights`) drawn as the attention
    kernels draw theirs, and with ``fusing``, on tensors that run lazily, an output that
    remembers its drawn key and the versions of ``x`` and itself, for what reads it to fuse
    with it (:func:`fused_add`, :func:`fused_matmul`, :func:`fused_linear`). ``x_sharding``: the
    sharding its kernel runs under (a module's, resolved when it was built), by default ``x``'s
    own."""
    drawn = functional.draw_dropout(x, p, training, None, None, impl, False,
                                    sharding.resolve(x) if x_sharding is None else x_sharding,
                                    attention_weights=is_attention_weights(x))
    if drawn is None:
        return x
    output = drawn.output()
    # Under torch.compile the backend fuses (see the module's docstring); eager CPU tensors'
    # kernel has run already.
    if (fusing and drawn.key_data is not None and not torch.compiler.is_compiling() and not bridge.is_dtensor(x)
            and bridge.runs_lazily(x)):
        _remember(output, _DRAWN, (x,), (next(_draws), drawn))
    return output


# Set on the output of a softmax over the last dim inside route_dropout, and kept by its dtype
# and device conversions: attention weights, whose dropout draws the attention kernels' mask.
_ATTENTION_WEIGHTS = "_torch_pallas_attention_weights"
# ``x.to(...)``, ``x.type(...)``, ``x.type_as(y)``, ``x.float()``, ``x.half()``, ``x.bfloat16()``:
# how models convert the softmax's output (GPT-2's ``.type(value.dtype)``, Llama's
# ``.to(query.dtype)`` of a float32 softmax, T5's ``.type_as(scores)``).
CONVERSIONS = (torch.Tensor.to, torch.Tensor.type, torch.Tensor.type_as, torch.Tensor.float, torch.Tensor.half,
               torch.Tensor.bfloat16)


def is_attention_weights(tensor) -> bool:
    """Whether ``tensor`` is attention weights as :func:`torch_pallas.route_dropout` knows them: the
    output of a softmax over its last dim computed inside it (``F.softmax``, ``torch.softmax``,
    ``Tensor.softmax``, whatever their dtype), or a dtype or device conversion of one
    (:data:`CONVERSIONS`). A flag on the tensor object, which dynamo traces."""
    return isinstance(tensor, torch.Tensor) and getattr(tensor, _ATTENTION_WEIGHTS, False)


def _mark_attention_weights(output) -> None:
    if isinstance(output, torch.Tensor) and output.dim() >= 2:
        setattr(output, _ATTENTION_WEIGHTS, True)


def converted(func, args, kwargs, widening: bool) -> torch.Tensor:
    """``func(*args, **kwargs)``, one of :data:`CONVERSIONS`: a conversion of attention weights
    is attention weights; with ``widening``, :func:`remembered_widening` for ``Tensor.to``."""
    output = remembered_widening(func, args, kwargs) if widening and func is torch.Tensor.to else func(*args, **kwargs)
    source = args[0] if args else None
    if (output is not source and is_attention_weights(source) and isinstance(output, torch.Tensor)
            and output.shape == source.shape):
        _mark_attention_weights(output)
    return output


def _remember(output: torch.Tensor, name: str, sources: tuple[torch.Tensor, ...], payload) -> None:
    """Keeps ``payload`` on ``output`` under ``name`` with the versions of ``output`` and of
    ``sources``, what it was computed from, for :func:`_recall`."""
    setattr(output, name, (payload, tuple((source, source._version) for source in sources), output._version))


def _recall(tensor, name: str):
    """What :func:`_remember` kept on ``tensor`` under ``name``, if neither it nor its sources
    have been written in place since (through any view: the version counters say so)."""
    remembered = getattr(tensor, name, None) if isinstance(tensor, torch.Tensor) else None
    if remembered is None:
        return None
    payload, sources, version = remembered
    unchanged = tensor._version == version and all(source._version == seen for source, seen in sources)
    return payload if unchanged else None


def _drawn_dropout_of(tensor) -> tuple[int, functional.DrawnDropout] | None:
    """The dropout whose output ``tensor`` is, and its number in :data:`_draws`, if neither
    it nor the dropout's input has been written in place since."""
    return _recall(tensor, _DRAWN)


def fused_add(func, args, kwargs) -> torch.Tensor | None:
    """The add ``func(*args, **kwargs)`` (one of :data:`ADDS`) as ``dropout_add`` of the
    remembered dropout one of its operands is and the other (a tensor of its shape, dtype and
    device), written into the first operand for ``add_``; ``None`` when it is not such an add."""
    try:
        input, other, alpha, out = _add_arguments(*args, **kwargs)
    except TypeError:
        return None  # torch will raise its own error
    if alpha != 1 or out is not None:
        return None
    if not _addable_in_one_kernel(input, other):
        return None
    candidates = [(found, residual) for found, residual in ((_drawn_dropout_of(input), other),
                                                             (_drawn_dropout_of(other), input)) if found is not None]
    if not candidates:
        return None
    (_, drawn), residual = max(candidates, key=lambda candidate: candidate[0][0])
    total = drawn.added_to(residual)
    return input.copy_(total) if func is torch.Tensor.add_ else total


# ``torch.matmul(a, b)``, ``a.matmul(b)`` and ``a @ b`` as a TorchFunctionMode sees them.
MATMULS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)
# ``F.softmax(x, dim)``, ``torch.softmax(x, dim)`` and ``x.softmax(dim)``.
# Each with its arguments' parser: plain functions, as route_dropout's (dynamo traces them).
SOFTMAXES = {torch.nn.functional.softmax: lambda input, dim=None, _stacklevel=3, dtype=None: (input, dim, dtype),
             torch.softmax: lambda input, dim, dtype=None: (input, dim, dtype),
             torch.Tensor.softmax: lambda input, dim, dtype=None: (input, dim, dtype)}
_SOFTMAX_OF = "_torch_pallas_softmax_of"


def remembered_softmax(func, args, kwargs, remember_scores: bool) -> torch.Tensor:
    """``func(*args, **kwargs)`` (one of :data:`SOFTMAXES`): over the last dim, attention weights
    (:func:`is_attention_weights`); with ``remember_scores``, on tensors that run lazily, a
    softmax in the input's dtype also remembers its input and the versions of both, so that a
    routed dropout of it and its product with a value run as one kernel (:func:`fused_matmul`)."""
    output = func(*args, **kwargs)
    try:
        scores, dim, dtype = SOFTMAXES[func](*args, **kwargs)
    except TypeError:
        return output
    if not (isinstance(scores, torch.Tensor) and isinstance(output, torch.Tensor) and scores.dim() >= 1
            and dim in (-1, scores.dim() - 1)):
        return output
    _mark_attention_weights(output)
    if remember_scores and dtype in (None, scores.dtype) and bridge.runs_lazily(scores):
        _remember(output, _SOFTMAX_OF, (scores,), scores)
    return output


# ``scores * c``, ``c * scores`` (both reach a mode as ``Tensor.mul(scores, c)``), ``scores / c``.
SCALINGS = {torch.mul: False, torch.Tensor.mul: False, torch.div: True, torch.Tensor.div: True}
# ``torch.where(keep, scores, fill)`` and ``scores.masked_fill(dropped, fill)``: scores masked
# with the dtype's lowest number (GPT-2's eager attention; transformers' masks).
# Each with its arguments' parser, giving (scores, mask, fill, out): the mask is where torch.where
# keeps a score, where masked_fill drops one.
SELECTIONS = {torch.where: lambda condition, input, other, *, out=None: (input, condition, other, out),
              torch.Tensor.masked_fill: lambda input, mask, value: (input, mask, value, None)}
_SCORES_OF = "_torch_pallas_scores_of"
# ``torch.full((), c)``: a number as a 0-dim tensor (GPT-2's eager attention divides its scores
# by one and masks them with another).
_full_arguments = (lambda size, fill_value, *, out=None, dtype=None, layout=None, device=None,  # noqa: E731
                   pin_memory=False, requires_grad=False: fill_value)
_NUMBER_OF = "_torch_pallas_number_of"


class AttentionScores(NamedTuple):
    """Attention scores as :func:`torch_pallas.scaled_dot_product_attention` computes them:
    ``query @ key_transposed * scale + mask``. ``mask_selects``: the mask holds only 0 and a
    fill so low that adding a score leaves it (a selection's); a mask added after it joins it
    without changing a result."""

    query: torch.Tensor
    key_transposed: torch.Tensor
    scale: float = 1.0
    mask: torch.Tensor | None = None
    mask_selects: bool = False

    def sources(self) -> tuple[torch.Tensor, ...]:
        return (self.query, self.key_transposed) + (() if self.mask is None else (self.mask,))

    def attend(self, value: torch.Tensor, drawn: functional.DrawnDropout) -> torch.Tensor | None:
        """``drawn.output() @ value`` for ``drawn`` a dropout of these scores' softmax: the
        attention with the dropout's key and ``p``; ``None`` where the attention op does not
        take the call (then the product is computed as written)."""
        query, key = self.query, self.key_transposed.transpose(-2, -1)
        if not (drawn.key_data is not None and isinstance(value, torch.Tensor) and value.dtype == query.dtype
                and value.device == query.device and value.shape[:-1] == key.shape[:-1] and value.numel()
                and query.numel() and not any(sharding.resolve(t) is not None for t in (*self.sources(), value))):
            return None
        return attention_ops.apply(query, key, value, self.mask, drawn.key_data, dropout_p=drawn.p, impl=drawn.impl,
                                   is_causal=False, scale=self.scale, enable_gqa=False)


def remembered_number(func, args, kwargs) -> torch.Tensor:
    """``torch.full(*args, **kwargs)``; on tensors that run lazily, a 0-dim one remembers the
    number it holds (in its dtype), which :func:`remembered_scores` takes as a Python number's."""
    output = func(*args, **kwargs)
    try:
        fill = _full_arguments(*args, **kwargs)
    except TypeError:
        return output
    if (isinstance(output, torch.Tensor) and output.dim() == 0 and output.is_floating_point()
            and isinstance(fill, numbers.Real) and not isinstance(fill, bool) and bridge.runs_lazily(output)):
        _remember(output, _NUMBER_OF, (), torch.tensor(fill, dtype=output.dtype).item())
    return output


def _number(value) -> float | None:
    """``value`` as a number: a Python number's, or a remembered 0-dim ``torch.full``'s."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return _recall(value, _NUMBER_OF)


def remembered_scores(func, args, kwargs) -> torch.Tensor:
    """``func(*args, **kwargs)`` (one of :data:`MATMULS`, :data:`SCALINGS`,
    :data:`SELECTIONS` or :data:`ADDS`); on tensors that run lazily, a step of eager
    attention's scores remembers the :class:`AttentionScores` it makes, so that a routed
    dropout of their softmax and its product with a value run as one attention
    (:func:`fused_matmul`). The steps: ``query @ key_transposed`` of one batch shape
    (``(*batch, L, E) @ (*batch, E, S)``, a float dtype of the kernels), then at most one
    scaling by a number (a Python number, or a 0-dim ``torch.full`` made in the scope), then
    at most one selection with a boolean mask that broadcasts to them and a fill of the
    dtype's lowest number (GPT-2's causal mask), then at most one added mask of the scores'
    dtype and device that broadcasts to them (transformers' additive attention mask). Not a
    fill of ``-inf``: a query that sees no key gets NaN from torch's softmax, 0 from the
    attention kernels."""
    output = func(*args, **kwargs)
    if func in SELECTIONS:
        scores = _selected_scores(func, args, kwargs, output)
        if scores is not None:
            _remember(output, _SCORES_OF, scores.sources(), scores)
        return output
    if not (isinstance(output, torch.Tensor) and len(args) == 2 and isinstance(args[0], torch.Tensor)):
        return output
    first, second = args
    scores = None
    if func in MATMULS and not kwargs:
        if (isinstance(second, torch.Tensor) and first.dim() == second.dim() >= 3
                and first.shape[:-2] == second.shape[:-2] and first.dtype == second.dtype
                and first.dtype in _checks.FLOAT_DTYPES and first.device == second.device
                and bridge.runs_lazily(first)):
            scores = AttentionScores(first, second)
    elif func in SCALINGS and not kwargs:
        earlier, number = _recall(first, _SCORES_OF), _number(second)
        if (earlier is not None and earlier.mask is None and number is not None and number != 0
                and output.dtype == first.dtype and output.shape == first.shape):
            factor = 1 / number if SCALINGS[func] else number
            scores = earlier._replace(scale=earlier.scale * factor)
    elif func in ADDS and func is not torch.Tensor.add_ and not kwargs and isinstance(second, torch.Tensor):
        for candidate, mask in ((first, second), (second, first)):
            earlier = _recall(candidate, _SCORES_OF)
            if (earlier is not None and (earlier.mask is None or earlier.mask_selects) and mask.dtype == candidate.dtype
                    and mask.device == candidate.device and output.shape == candidate.shape):
                # A selection's 0 leaves the added mask; its fill plus the added mask is a
                # masked score's value (the fill, or -inf where the added mask is low too) with
                # or without the score.
                scores = earlier._replace(mask=mask if earlier.mask is None else earlier.mask + mask,
                                          mask_selects=False)
                break
    if scores is not None:
        _remember(output, _SCORES_OF, scores.sources(), scores)
    return output


def _selected_scores(func, args, kwargs, output) -> AttentionScores | None:
    """The :class:`AttentionScores` of ``torch.where(keep, scores, fill)`` or
    ``scores.masked_fill(dropped, fill)`` (:data:`SELECTIONS`) for remembered unmasked
    scores, a boolean mask that broadcasts to them and a fill of the dtype's lowest number:
    their mask is 0 where a score is kept and the fill elsewhere, which the score plus it is
    too (a query that sees no key: a uniform softmax, as torch's)."""
    try:
        scores, keep, fill, out = SELECTIONS[func](*args, **kwargs)
    except TypeError:
        return None
    if out is not None:
        return None
    earlier, number = _recall(scores, _SCORES_OF), _number(fill)
    if not (earlier is not None and earlier.mask is None and isinstance(keep, torch.Tensor)
            and keep.dtype == torch.bool and keep.device == scores.device and isinstance(output, torch.Tensor)
            and output.shape == scores.shape and output.dtype == scores.dtype and number is not None
            and torch.tensor(number, dtype=scores.dtype).item() == torch.finfo(scores.dtype).min):
        return None
    if func is not torch.where:
        keep = ~keep
    zero, low = (torch.full((), n, dtype=scores.dtype, device=scores.device) for n in (0.0, number))
    return earlier._replace(mask=torch.where(keep, zero, low), mask_selects=True)


def fused_matmul(func, args, kwargs) -> torch.Tensor | None:
    """The product ``func(*args, **kwargs)`` (one of :data:`MATMULS`) of a remembered dropout's
    output (attention weights) and a value it pairs with in one kernel, as ``dropout_matmul``
    with the dropout's key; ``None`` when it is not such a product, or under ``torch.func``'s
    transforms and forward-mode AD, which the fused op's backward kernel does not serve."""
    if kwargs.get("out") is not None or len(args) != 2 or torch._C._functorch.peek_interpreter_stack() is not None:
        return None
    if forward_ad._current_level >= 0:
        return None
    found = _drawn_dropout_of(args[0])
    if found is None or not functional.fuses_matmul(found[1], args[1]):
        return None
    drawn = found[1]
    scores = _recall(drawn.x, _SOFTMAX_OF)  # the scores whose softmax the weights are
    attention = _recall(scores, _SCORES_OF)
    if attention is not None:
        # the whole attention in the flash (or heads-in-lanes) kernels: not even the scores are kept.
        attended = attention.attend(args[1], drawn)
        if attended is not None:
            return attended
    if (scores is not None and drawn.key_data is not None
            and dropout_matmul_kernels.rows_fit(*scores.shape[-2:], drawn.impl)):
        # softmax, dropout and product in one kernel: only the scores are kept for the backward pass.
        return dropout_matmul_ops.apply(scores, args[1], drawn.key_data, p=drawn.p, impl=drawn.impl, softmax=True)
    return drawn.multiplied_by(args[1])


_linear_arguments = lambda input, weight, bias=None: (input, weight, bias)  # noqa: E731


def fused_linear(args, kwargs, max_features: int | None = None) -> torch.Tensor | None:
    """``F.linear(*args, **kwargs)`` of a remembered dropout's output as ``dropout_linear`` with
    the dropout's key (bit for bit its mask, on every impl): the kernel reads the dropout's
    input, and autograd keeps that input instead of the dropped copy. ``None`` when it is not
    such a call, a weight of more than ``max_features`` output features, or a bias of another
    dtype, device or shape (torch's linear then runs, and raises where it would), or under
    ``torch.func``'s transforms and forward-mode AD, which the fused op's backward kernel does
    not serve."""
    if torch._C._functorch.peek_interpreter_stack() is not None or forward_ad._current_level >= 0:
        return None
    try:
        input, weight, bias = _linear_arguments(*args, **kwargs)
    except TypeError:
        return None  # torch will raise its own error
    found = _drawn_dropout_of(input)
    if found is None or not functional.fuses_linear(found[1], weight):
        return None
    if max_features is not None and weight.shape[0] > max_features:
        return None
    if bias is not None and not (isinstance(bias, torch.Tensor) and bias.dtype == input.dtype
                                 and bias.device == input.device and tuple(bias.shape) == (weight.shape[0],)):
        return None
    drawn = found[1]
    narrow = _recall(drawn.x, _WIDENED_FROM)
    return drawn.linear(weight, bias, narrow if narrow is not None and functional.fuses_linear(drawn, weight, narrow)
                        else None)


_WIDENED_FROM = "_torch_pallas_widened_from"


def remembered_widening(func, args, kwargs) -> torch.Tensor:
    """``Tensor.to(*args, **kwargs)``, whose output, where it is a lazily run 16-bit tensor made
    float32 (PEFT's cast of a bfloat16 model's activations to its float32 adapters' dtype),
    remembers the 16-bit tensor for :func:`fused_linear`: its kernel then reads it, not the
    float32 copy."""
    output = func(*args, **kwargs)
    source = args[0] if args else None
    if (isinstance(output, torch.Tensor) and isinstance(source, torch.Tensor) and output is not source
            and output.dtype == torch.float32 and source.dtype in (torch.bfloat16, torch.float16)
            and output.shape == source.shape and output.device == source.device and bridge.runs_lazily(source)):
        _remember(output, _WIDENED_FROM, (source,), source)
    return output


def fuse_residual_dropouts(graph_module: torch.fx.GraphModule) -> int:
    """Rewrites, in an ATen-level graph (AOTAutograd's), each ``aten.add.Tensor`` of a
    ``torch_pallas::dropout`` output that nothing else reads and a tensor of its shape, dtype
    and device into one ``torch_pallas::dropout_add`` with the dropout's key; returns how many.

    In a backward graph this fuses a dropout's gradient into the sum of gradients it joins.
    """
    graph = graph_module.graph
    dropout, dropout_add = torch.ops.torch_pallas.dropout.default, torch.ops.torch_pallas.dropout_add.default
    fused = 0
    for add in list(graph.nodes):
        if add.target is not torch.ops.aten.add.Tensor or add.kwargs.get("alpha", 1) != 1 or len(add.args) != 2:
            continue
        for dropped, residual in (add.args, add.args[::-1]):
            if not (isinstance(dropped, torch.fx.Node) and dropped.target is dropout and len(dropped.users) == 1
                    and isinstance(residual, torch.fx.Node)
                    and _addable_in_one_kernel(dropped.meta.get("val"), residual.meta.get("val"))):
                continue
            (x, key_data, p, impl, shared_over_first_dim, _, _, sharding_text, global_shape,
             global_offset) = _dropout_arguments(dropped)
            if shared_over_first_dim:
                continue
            with graph.inserting_before(add):
                total = graph.call_function(dropout_add, (x, residual, key_data, p, impl, sharding_text, global_shape,
                                                          global_offset))
            total.meta.update(add.meta)
            add.replace_all_uses_with(total)
            graph.erase_node(add)
            graph.erase_node(dropped)
            fused += 1
            break
    if fused:
        graph.lint()
        graph_module.recompile()
    return fused


def _dropout_arguments(node: torch.fx.Node) -> list:
    """A ``torch_pallas::dropout`` node's ten arguments, defaults filled in."""
    schema = torch.ops.torch_pallas.dropout.default._schema
    values = list(node.args)
    for argument in schema.arguments[len(values):]:
        values.append(node.kwargs.get(argument.name, argument.default_value))
    return values


def _addable_in_one_kernel(a, b) -> bool:
    """Whether ``a`` and ``b`` (tensors, or a graph's fake values of them) are tensors of one
    shape, dtype and device: dropout_add neither broadcasts nor promotes."""
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device))


def backend(graph_module: torch.fx.GraphModule, example_inputs):
    """The ``"torch_pallas"`` backend of ``torch.compile``: ``"openxla"``'s (AOTAutograd, then
    torch_xla's dynamo bridge) with :func:`fuse_residual_dropouts` run on the forward and
    backward graphs first. torch finds it by name through the package's
    ``torch_dynamo_backends`` entry point, so ``import torch_pallas`` registers nothing.

    Example::

        >>> step = torch.compile(step, backend="torch_pallas", fullgraph=True)

    Raises:
        RuntimeError: torch_xla is not installed (on torchax, ``jax.jit`` of a step under
            ``route_dropout()`` fuses instead).
    """
    from torch._dynamo.backends.common import aot_autograd

    compiler = bridge.graph_compiler()
    if compiler is None:
        raise RuntimeError(f"torch.compile(backend={BACKEND!r}) compiles with torch_xla, which is not installed; "
                           "on torchax, jit a step run under torch_pallas.route_dropout()")

    def fused_then_compiled(graph, inputs):
        fuse_residual_dropouts(graph)
        return compiler.compile_aot_graph(graph, inputs)

    return aot_autograd(fw_compiler=fused_then_compiled)(graph_module, example_inputs)
