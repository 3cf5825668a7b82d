"""The layers that need no torch import and work in a process that cannot import it (a JAX-only
process, as JAX's own Pallas kernels and tokamax's run in): the kernels, tpu_compile and
tpu_schedule; the torch API's names then raise an ImportError that says what works without it."""

import json
import os
from pathlib import Path
import subprocess
import sys

import pytest

from conftest import ON_TPU
from torch_pallas import tpu_compile

# Run by `python -c`: torch, torch_xla and torchax made unimportable (as if not installed).
WITHOUT_TORCH = """
import importlib, json, pkgutil, sys

BLOCKED = ("torch", "torch_xla", "torchax")
for name in BLOCKED:
    sys.modules[name] = None

def loaded():
    return sorted(name for name, module in sys.modules.items()
                  if module is not None and name.partition(".")[0] in BLOCKED)

report = {}
import torch_pallas.tpu_schedule  # pure Python
report["jax_after_tpu_schedule"] = "jax" in sys.modules
import torch_pallas.kernels
from torch_pallas import tpu_compile
for module in pkgutil.iter_modules(torch_pallas.kernels.__path__):
    importlib.import_module(f"torch_pallas.kernels.{module.name}")
report["kernel_modules"] = sorted(module.name for module in pkgutil.iter_modules(torch_pallas.kernels.__path__))
if sys.argv[1:] == ["compile"]:
    import functools
    import jax, jax.numpy as jnp
    from torch_pallas.kernels import sampling

    executable = tpu_compile.compile_for_tpu(
        functools.partial(sampling.uniform, shape=(8, 128), interpret=False),
        jax.ShapeDtypeStruct((2,), jnp.int32), generation="v5e")
    report["compiled"] = executable is not None
import torch_pallas
for attempt, statement in (("attribute", "torch_pallas.dropout"), ("from_import", "from torch_pallas import nn"),
                           ("unknown_name", "torch_pallas.no_such_name")):
    try:
        exec(statement)
    except Exception as error:
        report[attempt] = [type(error).__name__, str(error)]
report["torch_modules"] = loaded()
print(json.dumps(report))
"""


def test_the_pure_layers_import_and_compile_without_torch():
    compile_kernel = tpu_compile.available() and not ON_TPU  # on a TPU, this process holds libtpu
    result = subprocess.run([sys.executable, "-c", WITHOUT_TORCH, *(["compile"] if compile_kernel else [])],
                            cwd=Path(__file__).resolve().parents[2], env=dict(os.environ, JAX_PLATFORMS="cpu"),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["torch_modules"] == [] and report["jax_after_tpu_schedule"] is False
    assert {"prng", "dropout", "attention", "indrnn", "sampling"} <= set(report["kernel_modules"])
    assert report.get("compiled") is (True if compile_kernel else None)
    for attempt, name in (("attribute", "dropout"), ("from_import", "nn")):
        kind, message = report[attempt]
        assert kind == "ImportError" and message.startswith(f"torch_pallas.{name} needs torch"), message
        assert "torch_pallas.kernels" in message and "torch_pallas.tpu_compile" in message
    assert report["unknown_name"] == ["AttributeError", "module 'torch_pallas' has no attribute 'no_such_name'"]
