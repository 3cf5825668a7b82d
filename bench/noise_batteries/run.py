"""PractRand on the tiled impl's streams and the token sampler's: writes
bench/results/noise_batteries.{json,md}.

    python bench/noise_batteries/run.py --practrand PATH [--max-log2 35] [--only NAME ...]

PATH is a checkout of PractRand's public source (github.com/MartyMacGyver/PractRand; no
registry package exists); it is built here with g++ (its lib/, bin/ and VisualC_net/ folders are
Windows builds, left out), beside tiled_stream.c, the tiled impl written from its specification.
Before any battery the stream is checked bit for bit against the kernels (interpret mode, 32- and
16-bit uniforms, mixed key, two tiles) and the unmixed stream against the hash keyed by the seed's
words. Each stream runs `RNG_test stdin32 -tlmax 2^max-log2` (PractRand's core tests, standard
folding, stopping at a failure). The streams of two seeds are interleaved word by word: seed s + 1
at position p beside s at p + 1 is the pairing the unmixed key made alike in the first rounds.
sampler_stream.c is torch_pallas.sample_tokens' noise from its specification, checked against the
kernel's keys and ``jax.random.bits`` first: rows (s, p), (s + 1, p), (s, p + 1), (s + 1, p + 1)
interleaved word by word over Llama 3's vocabulary, then the next two positions.
"""

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "..", "results")
SEED = 42
# (name, tiled_stream's arguments, what it is); a name starting "sampler" runs sampler_stream.
STREAMS = [
    ("seeds s, s + 1 interleaved", [str(SEED), str(SEED + 1)], "the pairing that failed at 2^32 bytes unmixed"),
    ("seeds s, s + 1 interleaved, unmixed key", ["--unmixed", str(SEED), str(SEED + 1)],
     "the tiled impl until 2026-12-02: the control that must fail"),
    ("seeds s, s + 2^32 interleaved", [str(SEED), str(SEED + 2**32)], "key word 0 apart by 1: the next tile's counter"),
    ("seeds s, s ^ 2^31 interleaved", [str(SEED), str(SEED ^ 2**31)], "key word 1's top bit"),
    ("seed s", [str(SEED)], "one seed's elements in order"),
    ("seed s, 16-bit uniforms", ["--uniform-bits", "16", str(SEED)], "dropout's uniforms, two per word"),
    ("seeds s, s + 1 interleaved, 16-bit uniforms", ["--uniform-bits", "16", str(SEED), str(SEED + 1)],
     "dropout's uniforms of adjacent seeds"),
    ("sampler: seeds s, s + 1 and positions p, p + 1 interleaved", [str(SEED), "0"],
     "sample_tokens' rows of related requests and tokens, (s + 1, p) beside (s, p + 1) included"),
]
PROGRAMS = ("tiled_stream", "sampler_stream")


def build(practrand: str, directory: str) -> tuple[dict, str]:
    os.makedirs(directory, exist_ok=True)
    streams = {}
    for program in PROGRAMS:
        streams[program] = os.path.join(directory, program)
        subprocess.run(["gcc", "-O3", "-march=native", "-o", streams[program], os.path.join(HERE, f"{program}.c")],
                       check=True)
    tester = os.path.join(directory, "RNG_test")
    if not os.path.exists(tester):
        sources = [path for pattern in ("src/*.cpp", "src/RNGs/*.cpp", "src/RNGs/other/*.cpp", "tools/RNG_test.cpp")
                   for path in glob.glob(os.path.join(practrand, pattern))]
        subprocess.run(["g++", "-O3", "-std=c++11", "-I" + os.path.join(practrand, "include"), "-pthread", *sources,
                        "-o", tester], check=True)
    return streams, tester


def stream_words(stream: str, arguments, count: int) -> np.ndarray:
    out = subprocess.run([stream, "--check", str(count), *arguments], check=True, capture_output=True, text=True).stdout
    return np.array([int(line, 16) for line in out.split()], np.uint32)


def check_against_the_kernels(stream: str) -> str:
    """The stream's first two tiles = the kernels' bits (and the reference's hash unmixed)."""
    sys.path[:0] = [os.path.join(HERE, "..", "..", "tests")]
    import jax
    import jax.numpy as jnp
    from reference import key_data, numpy_tiled_view
    from torch_pallas.kernels import elementwise

    def kernel_bits(uniform_bits):
        words = elementwise.noise_map(jnp.asarray(key_data(SEED)), (128, 1024),
                                      lambda b: jax.lax.bitcast_convert_type(b, jnp.int32), jnp.int32,
                                      impl="tiled", interpret=True, uniform_bits=uniform_bits)
        return np.asarray(words).view(np.uint32).ravel()

    def packed(bits):
        uniforms = bits >> np.uint32(16)
        return uniforms[0::2] << np.uint32(16) | uniforms[1::2]

    np.testing.assert_array_equal(stream_words(stream, [str(SEED)], 128 * 1024), kernel_bits(32))
    np.testing.assert_array_equal(stream_words(stream, ["--uniform-bits", "16", str(SEED)], 64 * 1024),
                                  packed(kernel_bits(16)))
    unmixed = numpy_tiled_view(key_data(SEED).view(np.uint32), (128, 1024), (64, 1024), 32).ravel()
    np.testing.assert_array_equal(stream_words(stream, ["--unmixed", str(SEED)], 128 * 1024), unmixed)
    return "tiled_stream = the kernels' bits (32- and 16-bit uniforms, 2 tiles) and the unmixed reference"


def check_the_sampler_against_the_kernels(stream: str) -> str:
    """The sampler stream's rows = the kernel module's row keys and jax.random.bits of them."""
    import jax
    import jax.numpy as jnp
    from torch_pallas.kernels import token_sampling

    for seed, position in ((SEED, 0), (SEED + 1, 3), (2**64 - 1, 2**32 - 1)):
        words = np.array([[seed >> 32, seed & 0xFFFFFFFF]], np.uint32)
        key = np.array([word[0] for word in token_sampling.row_key_words(words, np.array([position], np.uint32))])
        want = np.asarray(jax.random.bits(jax.random.wrap_key_data(key.astype(np.uint32)), (4096,), jnp.uint32))
        np.testing.assert_array_equal(stream_words(stream, [str(seed), str(position)], 4096), want)
    return "sampler_stream = the kernels' row keys and jax.random.bits of them (3 rows, 4096 entries)"


def run_battery(stream: str, tester: str, arguments, max_log2: int) -> dict:
    """PractRand's verdict: the longest length tested, the first failure, every anomaly it
    reported (with its length), and the seconds taken."""
    start = time.time()
    producer = subprocess.Popen([stream, *arguments], stdout=subprocess.PIPE)
    # (a bare number N is 2^N bytes to RNG_test)
    result = subprocess.run([tester, "stdin32", "-tlmax", str(max_log2), "-multithreaded"], stdin=producer.stdout,
                            capture_output=True, text=True)
    producer.stdout.close()
    producer.kill()
    producer.wait()
    length, lengths, anomalies = None, [], []  # (2^length bytes, test, p, evaluation)
    for line in result.stdout.splitlines():
        if match := re.search(r"\(2\^(\d+) bytes\)", line):
            length = int(match.group(1))
            lengths.append(length)
        elif match := re.match(r"^\s+(\S+)\s+R=\s*\S+\s+p\s*=\s*(\S+)\s+(.+?)\s*$", line):
            anomalies.append((length, *match.groups()))
    failures = [a for a in anomalies if "FAIL" in a[3]]
    return {"arguments": arguments, "tested_to_log2": max(lengths) if lengths else None,
            "failed": bool(failures), "first_failure": f"{failures[0][1]} p = {failures[0][2]}" if failures else None,
            "anomalies": [f"{test} p = {p} {verdict.rstrip(' !')} at 2^{n}" for n, test, p, verdict in anomalies],
            "seconds": round(time.time() - start), "tail": result.stdout[-1500:]}


def write(results: dict, check: str) -> None:
    with open(os.path.join(RESULTS, "noise_batteries.json"), "w") as f:
        json.dump({"check": check, "streams": results}, f, indent=1)
    lines = ["# PractRand on the tiled impl's streams and the token sampler's", "",
             "`python bench/noise_batteries/run.py --practrand PATH` (PractRand 0.94 from "
             "MartyMacGyver/PractRand, core tests, standard folding, `RNG_test stdin32 -multithreaded`); "
             f"seed s = {SEED}. {check}. A stream passes to 2^N bytes when PractRand reports no failure "
             "at any length up to it; anomalies short of a failure are listed.", "",
             "| stream | what it is | result | anomalies (unusual or worse) | seconds |", "|---|---|---|---|---|"]
    for name, what in ((name, what) for name, _, what in STREAMS if name in results):
        r = results[name]
        verdict = (f"**fails** at 2^{r['tested_to_log2']} bytes: {r['first_failure']}" if r["failed"]
                   else f"passes to 2^{r['tested_to_log2']} bytes")
        lines.append(f"| {name} | {what} | {verdict} | {'; '.join(r['anomalies']) or 'none'} | {r['seconds']} |")
    with open(os.path.join(RESULTS, "noise_batteries.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--practrand", required=True, help="a checkout of MartyMacGyver/PractRand")
    parser.add_argument("--build", default="/tmp/torch_pallas_batteries")
    parser.add_argument("--max-log2", type=int, default=35, help="the longest stream, 2^N bytes")
    parser.add_argument("--only", nargs="*", help="names of STREAMS to run (default: all)")
    args = parser.parse_args()
    streams, tester = build(args.practrand, args.build)
    check = f"{check_against_the_kernels(streams['tiled_stream'])}; " \
            f"{check_the_sampler_against_the_kernels(streams['sampler_stream'])}"
    print(check, flush=True)
    path = os.path.join(RESULTS, "noise_batteries.json")
    results = json.load(open(path))["streams"] if os.path.exists(path) else {}
    for name, arguments, _ in STREAMS:
        if args.only and name not in args.only:
            continue
        program = "sampler_stream" if name.startswith("sampler") else "tiled_stream"
        results[name] = run_battery(streams[program], tester, arguments, args.max_log2)
        print(name, {k: v for k, v in results[name].items() if k != "tail"}, flush=True)
        write(results, check)


if __name__ == "__main__":
    main()
