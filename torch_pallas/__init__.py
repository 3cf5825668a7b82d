"""torch_pallas: JAX Pallas kernels as differentiable PyTorch ops, on torch_xla's XLA tensors,
torchax's tensors, TorchTPU's ``tpu`` tensors and plain CPU tensors.

Import order matters on TPU: :mod:`torch_pallas.bridge` (which on the torch_xla stack starts
torch_xla's PJRT client) is imported before anything that imports JAX.

Without torch (a process with JAX alone), the layers that need none still import:
:mod:`torch_pallas.kernels` (the Pallas kernels, called from JAX), :mod:`torch_pallas.tpu_compile`
and :mod:`torch_pallas.tpu_schedule`; the package then imports nothing itself, and the torch API's
names raise an ImportError that says so.
"""

__all__ = ["checkpoint", "dropout", "dropout_add", "dropout_linear", "dropout_matmul", "dropout1d", "dropout2d",
           "dropout3d", "indrnn", "convert_dropout", "register_attention", "route_dropout", "scaled_dot_product_attention",
           "nn", "packing", "random", "sample_tokens", "SeededSampling", "seeds"]
__version__ = "0.2.0"

try:
    import torch as _torch
except ModuleNotFoundError as error:
    if error.name != "torch":  # torch is there but broken: say so
        raise
    _torch_missing = error
else:
    _torch_missing = None
    del _torch

if _torch_missing is None:
    from torch_pallas import bridge  # noqa: F401  (first: see above)
    from torch_pallas import packing, random, seeds  # noqa: F401
    from torch_pallas import nn  # noqa: F401
    from torch_pallas.attention import scaled_dot_product_attention
    from torch_pallas.checkpointing import checkpoint
    from torch_pallas.functional import (dropout, dropout1d, dropout2d, dropout3d, dropout_add, dropout_linear,
                                         dropout_matmul, indrnn)
    from torch_pallas.nn import convert_dropout
    from torch_pallas.routing import route_dropout
    from torch_pallas.token_sampling import SeededSampling, sample_tokens
    from torch_pallas.transformers_attention import register_attention  # imports transformers only when called

    # Now, not at the first call: dynamo cannot trace the import of a front end, so a first call on
    # a CPU tensor (or a DTensor of them) inside torch.compile(fullgraph=True) would fail.
    bridge.front_end("cpu")
else:
    def __getattr__(name):
        if name in __all__:
            raise ImportError(
                f"torch_pallas.{name} needs torch, which this process cannot import ({_torch_missing}): from "
                "torch_pallas's source, pip install '.[xla]', '.[torchax]' or '.[torchtpu]'. Without torch, torch_pallas.kernels (the Pallas "
                "kernels, called from JAX), torch_pallas.tpu_compile and torch_pallas.tpu_schedule work",
                name=f"torch_pallas.{name}") from _torch_missing
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
