"""Public differentiable functions, one module per op."""

from torch_pallas.functional.dropout import dropout

__all__ = ["dropout"]
