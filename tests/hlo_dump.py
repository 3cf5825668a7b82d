"""What tests read in optimised HLO text: the partitioned HLO XLA dumps while SPMD tests run (both
stacks' tests/**/spmd, which run with ``--xla_dump_to`` set to ``$TORCH_PALLAS_HLO_DUMP``), and the
Mosaic kernels of a program compiled for TPU."""

import glob
import os
import re

import numpy as np

# A kernel's name is the scope its pallas_call runs in, the op_name's component before it; JAX's
# transforms wrap it ("transpose(jvp(NAME))"); an unnamed kernel's is its function's jit ("jit(f)").
_KERNEL_SCOPE = re.compile(r'op_name="(?:[^"]*/)?([^"/]*)/pallas_call"')
_WRAPPED_NAME = re.compile(r"(?:(\w+)\()*(\w+)\)*")
# As JAX writes it (torch_xla keeps it so), or as libtpu prints a program it compiled.
_COST_ESTIMATE = re.compile(r'"cost_estimate":\s*\{([^}]*)\}')
_COST = re.compile(r'"(\w+)":\s*"?(\d+)"?')


def compiled_modules(run):
    """The partitioned, optimised HLO of every module XLA compiles while ``run()`` runs."""
    pattern = os.path.join(os.environ["TORCH_PALLAS_HLO_DUMP"], "*after_optimizations.txt")
    before = set(glob.glob(pattern))
    run()
    return [open(path).read() for path in sorted(set(glob.glob(pattern)) - before)]


def all_gather_sizes(modules):
    """Element counts of every all-gather's result in ``modules``."""
    sizes = []
    for text in modules:
        for dims in re.findall(r"\[([\d,]*)\]\{[\d,]*\} all-gather\(", text):
            sizes.append(int(np.prod([int(d) for d in dims.split(",") if d])))
    return sizes


def tpu_kernels(hlo: str) -> list[tuple[str | None, dict | None]]:
    """``(name, cost estimate)`` of every Mosaic kernel (TPU custom call) in optimised HLO text, in
    order: the name its ``pallas_call`` was given, and its backend config's cost estimate
    (``{"flops": int, "transcendentals": int, "bytes_accessed": int, ...}``); ``None`` where it
    has none."""
    kernels = []
    for line in hlo.splitlines():
        if 'custom_call_target="tpu_custom_call"' not in line:
            continue
        scope, cost = _KERNEL_SCOPE.search(line), _COST_ESTIMATE.search(line)
        wrapped = scope and _WRAPPED_NAME.fullmatch(scope.group(1))
        named = wrapped and wrapped.group(1) != "jit"
        kernels.append((wrapped.group(2) if named else None,
                        cost and {key: int(value) for key, value in _COST.findall(cost.group(1))}))
    return kernels
