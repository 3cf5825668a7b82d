"""torch_pallas's attention where Hugging Face transformers looks for it: its
``AttentionInterface``, so that a model built or loaded with ``attn_implementation="torch_pallas"``
runs :func:`torch_pallas.scaled_dot_product_attention` (flash kernels, in-kernel dropout).

transformers is optional and slow to import: nothing here imports it until
:func:`register_attention` is called.
"""

from __future__ import annotations

import torch

from torch_pallas import _checks
from torch_pallas.attention import scaled_dot_product_attention

__all__ = ["register_attention", "attention_forward"]

# transformers 4.48 introduced AttentionInterface (and models that call through it).
MINIMUM_TRANSFORMERS = "4.48"
# name -> the function registered under it by register_attention (idempotence, and not
# replacing somebody else's function).
_registered: dict[str, object] = {}


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, position_bias: torch.Tensor | None = None, *, impl=None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    r"""transformers' attention-function signature (what its ``sdpa_attention_forward`` takes)
    on :func:`torch_pallas.scaled_dot_product_attention`.

    Args:
        module (nn.Module): the attention layer; its ``num_key_value_groups`` (GQA) and
            ``is_causal`` are read, and its ``training`` flag: out of training no dropout is
            applied whatever ``dropout`` says.
        query (Tensor): ``(batch, heads, L, E)``.
        key, value (Tensor): ``(batch, kv_heads, S, E)`` and ``(batch, kv_heads, S, Ev)``;
            ``heads`` a multiple of ``kv_heads`` (run as ``enable_gqa=True``: the kernels read
            the shared heads, nothing is repeated in memory).
        attention_mask (Tensor, optional): boolean (True attends) or additive float mask,
            broadcastable to ``(batch, heads, L, S)``; a 4-D mask longer than ``S`` is cut to
            ``S`` (as transformers' ``sdpa``). A float mask of a dtype other than the query's
            is converted to the query's, its values clamped to that dtype's range.
        dropout (float): the attention dropout probability the model passes (0 in eval).
        scaling (float, optional): the scores' factor (default :math:`1/\sqrt{E}`).
        is_causal (bool, optional): default ``module.is_causal`` (True if absent); applied
            only without a mask and with more than one query, as transformers 5's ``sdpa``.
        position_bias (Tensor, optional): an additive score bias (transformers 5's T5-style
            models), combined with the mask as transformers' ``sdpa`` does.
        impl (str, optional): the dropout noise impl (``"threefry"``, ``"tiled"`` or ``"hardware"``).

    Returns:
        (Tensor, None): the output ``(batch, L, heads, Ev)`` and no attention weights (they
        never exist in memory).

    Raises:
        ValueError: ``softcap`` (not supported, as by transformers' ``sdpa``), and whatever
            :func:`torch_pallas.scaled_dot_product_attention` raises.
    """
    if kwargs.get("softcap") is not None:
        raise ValueError("torch_pallas attention does not support `softcap` (nor does transformers' sdpa): use "
                         "attn_implementation='eager' for this model")
    if kwargs.get("output_attentions", False) or kwargs.get("head_mask") is not None:
        _logger().warning_once("torch_pallas attention does not support `output_attentions=True` or `head_mask` "
                               "(the attention weights never exist in memory); they are ignored.")
    enable_gqa = getattr(module, "num_key_value_groups", 1) > 1
    q_length = query.shape[2]
    if attention_mask is not None and attention_mask.ndim == 4 and attention_mask.shape[-1] > key.shape[-2]:
        attention_mask = attention_mask[:, :, :, :key.shape[-2]]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # transformers 5's rule (4.57's, when it computes is_causal itself): a mask carries the
    # pattern, and a single query attends to everything.
    is_causal = bool(q_length > 1 and attention_mask is None and is_causal)
    if position_bias is not None:
        attention_mask = _position_bias_mask(position_bias, attention_mask, is_causal, query, key)
        is_causal = False
    if attention_mask is not None and attention_mask.dtype != torch.bool and attention_mask.dtype != query.dtype:
        # e.g. a float32 additive mask (finfo(float32).min) beside bfloat16 activations
        if not attention_mask.is_floating_point():
            raise TypeError(f"torch_pallas attention takes a boolean or float attention_mask, got "
                            f"{attention_mask.dtype}")
        attention_mask = attention_mask.to(query.dtype).clamp(min=torch.finfo(query.dtype).min)
    dropout_p = float(dropout) if getattr(module, "training", True) else 0.0
    output = scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scaling, enable_gqa=enable_gqa, impl=impl)
    return output.transpose(1, 2).contiguous(), None


def _position_bias_mask(position_bias, attention_mask, is_causal, query, key) -> torch.Tensor:
    """transformers 5's ``create_position_bias_mask``: the bias where a query may attend, the
    dtype's minimum where it may not, as one additive float mask."""
    lowest = torch.finfo(position_bias.dtype).min
    if attention_mask is None:
        if not is_causal:
            return position_bias
        causal = (torch.arange(query.shape[2], device=key.device)[:, None]
                  >= torch.arange(key.shape[2], device=key.device)[None, :])
        return torch.where(causal.view(1, 1, *causal.shape), position_bias, lowest)
    if attention_mask.dtype == torch.bool:
        return torch.where(attention_mask, position_bias, lowest)
    return position_bias + attention_mask


def _logger():
    from transformers.utils import logging
    return logging.get_logger(__name__)


def _transformers():
    try:
        import transformers
    except ImportError as error:
        raise ImportError("torch_pallas.register_attention needs Hugging Face transformers "
                          f"(>= {MINIMUM_TRANSFORMERS}): pip install 'transformers>={MINIMUM_TRANSFORMERS}'") from error
    if not hasattr(transformers, "AttentionInterface"):
        raise ImportError(f"torch_pallas.register_attention needs transformers >= {MINIMUM_TRANSFORMERS} (its "
                          f"AttentionInterface); transformers {transformers.__version__} is installed")
    return transformers


def register_attention(name: str = "torch_pallas", *, impl: str | None = None) -> str:
    r"""Registers :func:`torch_pallas.scaled_dot_product_attention` with Hugging Face
    transformers' ``AttentionInterface`` under ``name``, so that a model built or loaded with
    ``attn_implementation=name`` (``from_pretrained``, ``from_config``, a config's
    ``attn_implementation``, or ``model.set_attn_implementation(name)`` on a built model) runs
    its attention in torch_pallas's flash kernels, the attention dropout drawn in the kernels
    from an 8-byte key and regenerated in the backward pass.

    The function mirrors transformers' own ``sdpa`` attention (``sdpa_attention_forward``):
    the mask transformers builds for ``sdpa`` (registered for ``name`` too, in
    ``AttentionMaskInterface`` where it exists), cut to the keys' length, or ``is_causal`` when
    there is none; grouped-query heads as ``enable_gqa`` (never repeated in memory); the
    layer's ``scaling``; its ``dropout`` while the layer is training and none otherwise.
    Dropout keys come from the tensors' device RNG, as for every torch_pallas op (or from the
    enclosing :func:`torch_pallas.seeds.key_scope`). Models that call through the interface are
    those transformers marks ``_supports_attention_backend`` (GPT-2 and Llama in 4.57; BERT
    from transformers 5 on); others reject or ignore the name as transformers decides.

    Registering the same name again is harmless (and updates ``impl``). transformers is
    imported by this call, not by ``import torch_pallas``.

    Args:
        name (str): the ``attn_implementation`` name. Default ``"torch_pallas"``.
        impl (str, optional): the dropout noise impl, as for :func:`torch_pallas.dropout`
            (``None``: :func:`torch_pallas.random.get_default_impl` at each call).

    Returns:
        str: ``name``.

    Raises:
        ImportError: transformers is not installed, or older than 4.48 (no
            ``AttentionInterface``).
        ValueError: ``name`` is already one of transformers' attention implementations or
            another function's (``"sdpa"``, ``"eager"``, ...), or ``impl`` is unknown.
        TypeError: ``name`` is not a non-empty string.

    Example::

        >>> torch_pallas.register_attention()
        'torch_pallas'
        >>> model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="torch_pallas")
        >>> model.to(torch_xla.device()).train()(input_ids=ids, labels=ids).loss.backward()
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty string, got {name!r}")
    _checks.resolve_impl(impl)
    transformers = _transformers()
    interface = transformers.AttentionInterface
    current = interface._global_mapping.get(name)
    if name == "eager" or (current is not None and current is not _registered.get(name)):
        raise ValueError(f"attn_implementation {name!r} is already registered with transformers "
                         f"({getattr(current, '__qualname__', 'eager')}): pick another name for torch_pallas's "
                         "attention")

    def torch_pallas_attention(module, query, key, value, attention_mask, *args, **kwargs):
        return attention_forward(module, query, key, value, attention_mask, *args, impl=impl, **kwargs)

    torch_pallas_attention.__doc__ = attention_forward.__doc__
    interface.register(name, torch_pallas_attention)
    _registered[name] = torch_pallas_attention
    masks = getattr(transformers, "AttentionMaskInterface", None)  # transformers >= 4.53: masks per implementation
    if masks is not None:
        masks.register(name, masks._global_mapping["sdpa"])  # boolean masks (None where is_causal does)
    return name
