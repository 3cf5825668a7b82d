"""The CPU front end: plain CPU tensors, handed to JAX on the CPU through DLPack (no copy),
where the kernels run jitted in interpret mode (Mosaic kernels run only on TPUs, and these
kernels use TPU memory spaces that Pallas's GPU lowering does not have), and back."""

from __future__ import annotations

import torch
import torch.utils.checkpoint

from torch_pallas import bridge


# torch's CPU allocator aligns every buffer to 64 bytes, as jaxlib wants a buffer it shares.
_DLPACK_ALIGNMENT = 64


IMPLEMENTS = (bridge.FrontEnd,)
DEVICE_DESCRIPTION = "the CPU"
MOVE_HINT = "'cpu'"
GENERATOR_DEVICE_TYPES = ("cpu",)
GENERATORS = "a CPU torch.Generator"
SEEDED_BY = "torch.manual_seed"
CHECKPOINT_FUNCTIONS = ()


def platform_is_tpu() -> bool:
    return False


def default_device() -> torch.device:
    return torch.device("cpu")


def check_device_usable(device: torch.device) -> None:
    """CPU tensors can always be made."""


def runs_lazily(tensor: torch.Tensor) -> bool:
    """CPU tensors run each op when it is called."""
    return False


def draw_key_words(device: torch.device) -> torch.Tensor:
    """Two int32 words from torch's default generator (``torch.manual_seed``)."""
    return bridge.torch_key_words(device)


def _shareable(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a buffer JAX can share: detached (DLPack exports no tensor that requires
    grad; autograd is above this layer), contiguous, and aligned (a view at an offset, such
    as one sample's key under vmap, is copied here rather than by jaxlib, which logs it)."""
    tensor = tensor.detach().contiguous()
    return tensor.clone() if tensor.data_ptr() % _DLPACK_ALIGNMENT else tensor


def call(jax_function, tensors, static: dict):
    import jax

    arrays = [jax.dlpack.from_dlpack(_shareable(tensor)) for tensor in tensors]
    outputs = bridge.jitted(jax_function, tuple(sorted(static.items())), True)(*arrays)
    return jax.tree.map(torch.from_dlpack, outputs)


def check_use_reentrant(use_reentrant) -> None:
    """Either form is torch's."""


def checkpoint(region, *args, use_reentrant, preserve_rng_state):
    """torch's own checkpoint (reentrant unless told otherwise, as torch_xla's), for CPU and
    torchax tensors."""
    return torch.utils.checkpoint.checkpoint(region, *args, use_reentrant=use_reentrant is not False,
                                             preserve_rng_state=preserve_rng_state)


def register_op(op, compute, formula) -> None:
    """CPU tensors reach a custom op through torch's dispatcher, which knows it already."""


def defer_function_to_mode(func, mode_type) -> None:
    """CPU tensors take no torch function before torch's mode stack does."""
