"""Pure JAX + Pallas kernels. Nothing here imports torch."""
