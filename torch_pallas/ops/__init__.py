"""``torch.library`` custom ops around the Pallas kernels (one module per op).

Each op has a fake (meta) function, so ``torch.compile(backend="openxla", fullgraph=True)``
traces through it without breaking the graph, and differentiable ops register autograd.
"""
