"""Sharded torchax tensors: tests/torchax/spmd/ runs in a process of its own on 4 CPU devices
(XLA's host device count is read once, when JAX starts), with XLA dumping the compiled HLO."""

import os
import subprocess
import sys

import pytest

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.own_process
def test_sharded_runs_in_their_own_process_on_four_devices(tmp_path):
    """tests/torchax/spmd/: dropout, random sampling with a mesh, attention and IndRNN on arrays
    sharded over a jax Mesh equal the unsharded calls bit for bit, keep the sharding (gradients
    too), run their kernels per shard and gather no activations."""
    dump = tmp_path / "hlo"
    flags = f"--xla_force_host_platform_device_count=4 --xla_dump_to={dump} --xla_dump_hlo_as_text"
    env = dict(os.environ, TORCH_PALLAS_HLO_DUMP=str(dump),
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip())
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "torchax/spmd"],
                            cwd=TESTS, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-4000:]
    assert " passed" in result.stdout and " failed" not in result.stdout
