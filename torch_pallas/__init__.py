"""torch_pallas: JAX Pallas kernels as differentiable PyTorch ops, on torch_xla's XLA tensors,
torchax's tensors and plain CPU tensors.

Import order matters on TPU: :mod:`torch_pallas.bridge` (which on the torch_xla stack starts
torch_xla's PJRT client) is imported before anything that imports JAX.
"""

from torch_pallas import bridge  # noqa: F401  (first: see above)
from torch_pallas import packing, random, seeds  # noqa: F401
from torch_pallas import nn  # noqa: F401
from torch_pallas.attention import scaled_dot_product_attention
from torch_pallas.checkpointing import checkpoint
from torch_pallas.functional import dropout, dropout1d, dropout2d, dropout3d, dropout_add, dropout_matmul, indrnn
from torch_pallas.nn import convert_dropout
from torch_pallas.routing import route_dropout
from torch_pallas.transformers_attention import register_attention  # imports transformers only when called

__all__ = ["checkpoint", "dropout", "dropout_add", "dropout_matmul", "dropout1d", "dropout2d", "dropout3d", "indrnn",
           "convert_dropout", "register_attention", "route_dropout", "scaled_dot_product_attention", "nn", "packing",
           "random", "seeds"]
__version__ = "0.1.0"
