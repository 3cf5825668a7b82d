"""torch_pallas's kept sets against tpu-inference's top-k and top-p masks (vLLM's TPU sampler), on
the same logits and parameters: does ``SamplingParams(top_k=..., top_p=...)`` keep the same
tokens through either sampler?

    .venv/xla/bin/python bench/tpu_inference_masks.py

tpu-inference 0.32.0 cannot be installed beside a stack here: it pins jax 0.11.2, which needs
Python 3.12 (this machine has 3.11; the stacks pin jax 0.7.1 and 0.10.2), and its sampler module
imports vllm. Its masks (``tpu_inference/layers/common/binary_search.py``) import jax alone, so this
script downloads the wheel (``pip download --no-deps``, into a temporary directory), loads that one
file, and applies ``topk_mask`` and ``topp_mask`` as its ``_apply_sampling_transforms`` does
(logits over the temperature, top-k where k > 0, then top-p where p < 1, masked to -1e12).
torch_pallas's kept set is ``ordered_key(logits) >= keep_threshold(...)``. Written to
``results/tpu_inference_masks.{json,md}``.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile

import numpy as np
import jax
import jax.numpy as jnp

import common
from torch_pallas.kernels import token_sampling

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from reference import kept_by_definition  # noqa: E402  (the tests' float64 definition of a kept set)

TPU_INFERENCE = "tpu-inference==0.32.0"
MASKS = "tpu_inference/layers/common/binary_search.py"
VOCABULARY = 32000
ROWS = 256
TOP_K = (0, 1, 5, 50, 1000)
TOP_P = (1.0, 0.5, 0.9, 0.95, 0.99)


def load_masks(directory: str):
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", directory, TPU_INFERENCE],
                   check=True)
    wheel, = glob.glob(f"{directory}/tpu_inference-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        path = archive.extract(MASKS, directory)
    spec = importlib.util.spec_from_file_location("tpu_inference_binary_search", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rows(rng, tied: bool):
    """Logits shaped like a language model's (a few large, a long tail), each row its own scale;
    ``tied``: rounded to halves, so thresholds fall on ties."""
    logits = rng.standard_normal((ROWS, VOCABULARY)) * rng.uniform(1, 4, (ROWS, 1))
    logits[:, :20] += rng.uniform(0, 8, (ROWS, 20))
    if tied:
        logits = np.round(logits * 2) / 2
    return dict(logits=logits.astype(np.float32), temperature=rng.uniform(0.3, 1.5, ROWS).astype(np.float32),
                top_k=rng.choice(TOP_K, ROWS).astype(np.int32), top_p=rng.choice(TOP_P, ROWS).astype(np.float32))


def theirs(masks, logits, temperature, top_k, top_p):
    """tpu-inference's _apply_sampling_transforms (0.32.0), its kept set."""
    scaled = logits / temperature[:, None]
    scaled = jnp.where((top_k > 0)[:, None], masks.topk_mask(scaled, top_k, replace_val=-1e12), scaled)
    scaled = jnp.where((top_p < 1.0)[:, None], masks.topp_mask(scaled, top_p, replace_val=-1e12), scaled)
    return scaled != np.float32(-1e12)


def ours(logits, temperature, top_k, top_p):
    threshold = token_sampling.keep_threshold(logits, temperature, top_k, top_p)
    return token_sampling.ordered_key(logits) >= threshold[:, None]


def compare(masks, case) -> dict:
    arguments = (case["logits"], case["temperature"], case["top_k"], case["top_p"])
    want = np.asarray(jax.jit(lambda *a: theirs(masks, *a))(*arguments))
    got = np.asarray(jax.jit(ours)(*arguments))
    differ = (want != got).any(axis=1)
    logits = case["logits"].astype(np.float64) / case["temperature"][:, None]
    probabilities = np.exp(logits - logits.max(axis=1, keepdims=True))
    probabilities /= probabilities.sum(axis=1, keepdims=True)
    differing_mass = [float(probabilities[b][want[b] != got[b]].sum()) for b in np.flatnonzero(differ)]
    exact = [kept_by_definition(case["logits"][b], case["temperature"][b], case["top_k"][b], case["top_p"][b], 0.0)
             for b in np.flatnonzero(differ)]
    return dict(rows=ROWS, differing_rows=int(differ.sum()),
                ours_as_defined=sum(bool(np.array_equal(got[b], e)) for b, e in zip(np.flatnonzero(differ), exact)),
                theirs_as_defined=sum(bool(np.array_equal(want[b], e))
                                      for b, e in zip(np.flatnonzero(differ), exact)),
                differing_tokens=int((want != got).sum()), most_differing_mass=max(differing_mass, default=0.0),
                filtered_rows=int(((case["top_k"] > 0) | (case["top_p"] < 1)).sum()),
                kept_tokens=int(want.sum()))


def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        masks = load_masks(directory)
    rng = np.random.default_rng(0)
    results = {name: compare(masks, rows(rng, tied)) for name, tied in (("distinct logits", False),
                                                                         ("logits in halves (ties)", True))}
    table = common.markdown_table(
        ["logits", "rows", "rows filtered", "tokens kept (tpu-inference)", "rows whose kept sets differ",
         "tokens in which they differ", "largest probability of a row's differing tokens",
         "of those rows, torch_pallas's = float64's", "tpu-inference's = float64's"],
        [(name, r["rows"], r["filtered_rows"], r["kept_tokens"], r["differing_rows"], r["differing_tokens"],
          r["most_differing_mass"], r["ours_as_defined"], r["theirs_as_defined"]) for name, r in results.items()])
    notes = (f"\nV = {VOCABULARY}; temperatures in [0.3, 1.5]; top-k from {TOP_K} (0: off) and top-p from {TOP_P} "
             "(1: off), independently per row. tpu-inference's masks are "
             f"{TPU_INFERENCE}'s {MASKS}, applied as its _apply_sampling_transforms applies them. The probability "
             "of a row's differing tokens is in float64, under softmax(logits / T); float64's kept set is the "
             "definition both state (top-k with ties, then the fewest largest reaching top-p, ties kept) computed "
             "in float64.\n")
    common.write("tpu_inference_masks", dict(mode="CPU, the masks only", package=TPU_INFERENCE, vocabulary=VOCABULARY,
                                             results=results),
                 table + notes, None)
    print(table + notes)


if __name__ == "__main__":
    main()
