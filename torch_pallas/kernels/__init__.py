"""Pure JAX + Pallas kernels. Nothing here imports torch."""

from torch_pallas.kernels import compat as _compat

# Before any kernel is lowered, whoever imports the kernels (the bridges, JAX users).
_compat.pin_mosaic_ir_version()
