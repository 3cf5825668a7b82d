"""Attention cases both stacks' tests compare with torch's SDPA: shapes and options, masks made
on the CPU (each test moves them to its device)."""

import torch


def fully_masked_row_mask():
    mask = torch.rand(2, 1, 24, 40, generator=torch.Generator().manual_seed(2)) > 0.3
    mask[:, :, 5] = False  # nothing to attend to: zeros, as torch's
    return mask


# name -> ((query, key, value shapes), options; a callable option is made anew per use)
CASES = {
    "causal-L-ne-S": (((2, 3, 24, 16), (2, 3, 40, 16), (2, 3, 40, 8)), dict(is_causal=True)),
    "bool-mask": (((2, 3, 24, 16), (2, 3, 40, 16), (2, 3, 40, 16)), dict(attn_mask=fully_masked_row_mask)),
    "gqa-scale": (((2, 4, 24, 16), (2, 2, 40, 16), (2, 2, 40, 16)), dict(enable_gqa=True, scale=0.2)),
    # 128 tokens, head dim 64, no mask: kernels.heads_in_lanes
    "heads-in-lanes-causal": (((2, 2, 128, 64),) * 3, dict(is_causal=True)),
}


def sharded_case(gqa: bool):
    """The SPMD tests' operands: query (4, 8, 32, 16), key and value with 4 (GQA) or 8 heads over
    48 positions, a boolean mask broadcast over heads, and the call's options."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(4, 8, 32, 16, generator=generator)
    key, value = (torch.randn(4, 4 if gqa else 8, 48, 16, generator=generator) for _ in range(2))
    mask = torch.rand(4, 1, 32, 48, generator=generator) > 0.2
    return query, key, value, mask, dict(dropout_p=0.3, seed=5, enable_gqa=gqa)
