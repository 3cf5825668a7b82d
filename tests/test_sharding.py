"""torch_pallas.sharding: parsing torch_xla's sharding text here; everything that needs SPMD
mode runs in tests/spmd/ in a process of its own on 4 CPU devices (launched below)."""

import os
import subprocess
import sys

import pytest

from torch_pallas.sharding import Sharding

TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("text,tiles,replicas,devices", [
    ("{devices=[4,1]0,1,2,3}", (4, 1), 1, (0, 1, 2, 3)),
    ("{devices=[2,1,2]0,1,2,3 last_tile_dim_replicate}", (2, 1), 2, (0, 1, 2, 3)),
    ("{devices=[1,2,2]0,2,1,3}", (1, 2, 2), 1, (0, 2, 1, 3)),
])
def test_tiled_text_round_trips(text, tiles, replicas, devices):
    sharding = Sharding.parse(text)
    assert (sharding.tiles, sharding.replicas, sharding.device_ids) == (tiles, replicas, devices)
    assert sharding.text == text


def test_replicated_or_unsharded_is_none_and_other_forms_are_named():
    assert Sharding.parse("") is None and Sharding.parse("{replicated}") is None
    assert Sharding.parse("{devices=[1,1,4]0,1,2,3 last_tile_dim_replicate}") is None
    with pytest.raises(ValueError, match="maximal device=0"):
        Sharding.parse("{maximal device=0}")
    with pytest.raises(ValueError, match="3 dims"):
        Sharding.parse("{devices=[4,1]0,1,2,3}", rank=3)


def test_permute_moves_tiles_and_devices():
    # (B, T, F) split 2 x 1 x 2 seen as (T, B, F): the device grid is transposed with it.
    sharding = Sharding.parse("{devices=[2,1,2]0,1,2,3}").permute((1, 0, 2))
    assert sharding.tiles == (1, 2, 2) and sharding.device_ids == (0, 1, 2, 3)
    assert Sharding.parse("{devices=[2,2,1]0,1,2,3}").permute((1, 0, 2)).device_ids == (0, 2, 1, 3)


@pytest.mark.parametrize("impl", ["hardware", "tiled", "threefry"])
def test_noise_follows_any_even_shards(impl):
    rows, columns = Sharding.parse("{devices=[4,1]0,1,2,3}"), Sharding.parse("{devices=[1,4]0,1,2,3}")
    rows.check((512, 1024), "x", impl)  # 128 rows: two bands of (64, 1024) seed tiles each
    rows.check((128, 1024), "x", impl)  # 32 rows: half a band (drawn in the band that covers it)
    columns.check((512, 1024), "x", impl)
    Sharding.parse("{devices=[2,1,1]0,1}").check((16, 13, 256), "x", impl)  # seen swapped by the per-tile impls


def test_a_dtensor_shard_of_whole_bands_off_a_band_is_refused_naming_threefry():
    from torch_pallas import dtensors

    # (640, 1024) has (64, 1024) tiles: a 64-row shard is a whole band, drawn as it is where it starts at one.
    dtensors._check_starts_where_the_kernel_takes_it((64, 1024), (640, 1024), (128, 0), "tiled", False)
    dtensors._check_starts_where_the_kernel_takes_it((32, 1024), (640, 1024), (16, 0), "tiled", False)  # covered
    with pytest.raises(ValueError, match=r"shard of shape \(64, 1024\) at \(32, 0\).*does not.*threefry"):
        dtensors._check_starts_where_the_kernel_takes_it((64, 1024), (640, 1024), (32, 0), "tiled", False)


def test_uneven_shards_are_refused_with_the_dim():
    with pytest.raises(ValueError, match="along dim 1, which does not divide 130"):
        Sharding.parse("{devices=[1,4]0,1,2,3}").shard_shape((8, 130), "x")


# tests/spmd/ in one process, run first: split in two, each starting XLA's four devices and
# compiling the kernels both use, it took 20 % more CPU time.
@pytest.mark.own_process
def test_sharded_runs_in_their_own_process_on_four_devices(tmp_path, pytestconfig):
    """tests/spmd/: noise equal to the unsharded run for (4,1), (1,4), (2,2) meshes, 2-D and 3-D
    tensors; no all-gather of activations; shardings kept; IndRNN gradients equal."""
    dump = tmp_path / "hlo"
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4", TORCH_PALLAS_HLO_DUMP=str(dump),
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump} --xla_dump_hlo_as_text".strip())
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "spmd",
                             *(["--slow"] if pytestconfig.getoption("--slow") else [])],
                            cwd=TESTS, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-4000:]
    assert " passed" in result.stdout and " failed" not in result.stdout
