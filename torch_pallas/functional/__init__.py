"""Public differentiable functions, one module per op."""

from torch_pallas.functional.dropout import dropout
from torch_pallas.functional.indrnn import indrnn

__all__ = ["dropout", "indrnn"]
