"""Runs the benchmarks and writes bench/results/<name>.{json,md,png}.

    ./dev bench                 # quick mode (a few minutes on 2 CPU cores)
    ./dev bench --full          # full mode (adds sizes, repeats, the unrolled-loop compile at T=1000)
    ./dev bench --only dropout  # one of: dispatch, dropout, indrnn, interpret_choices, runtime, training, tpu_compile,
                                # tpu_step, sharding
"""

import argparse
import os
import sys
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch_pallas  # noqa: E402,F401  (torch_xla before JAX)
from torch_pallas import tpu_compile  # noqa: E402

if tpu_compile.available():
    tpu_compile.enable_estimates()  # before any benchmark compiles: tpu_step's estimates read the dumps

import bench_dispatch  # noqa: E402
import bench_dropout  # noqa: E402
import bench_indrnn  # noqa: E402
import bench_interpret_choices  # noqa: E402
import bench_runtime  # noqa: E402
import bench_sharding  # noqa: E402
import bench_tpu_compile  # noqa: E402
import bench_tpu_step  # noqa: E402
import bench_training  # noqa: E402

BENCHMARKS = {"dispatch": bench_dispatch, "dropout": bench_dropout, "indrnn": bench_indrnn,
              "interpret_choices": bench_interpret_choices, "runtime": bench_runtime, "training": bench_training,
              "tpu_compile": bench_tpu_compile, "tpu_step": bench_tpu_step, "sharding": bench_sharding}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="full mode instead of quick")
    parser.add_argument("--only", choices=sorted(BENCHMARKS), action="append", help="run only these")
    args = parser.parse_args()
    for name in args.only or BENCHMARKS:
        start = time.perf_counter()
        print(f"== {name} ({'full' if args.full else 'quick'})", flush=True)
        print(BENCHMARKS[name].run(args.full), flush=True)
        print(f"   {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
