"""The partitioned HLO XLA dumps while SPMD tests run (both stacks' tests/**/spmd, which run with
``--xla_dump_to`` set to ``$TORCH_PALLAS_HLO_DUMP``)."""

import glob
import os
import re

import numpy as np


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
