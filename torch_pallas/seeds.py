"""Torch seeds to JAX threefry key data.

A seed is a 64-bit integer ``s``; its key is the ``threefry2x32`` key with data
``[s >> 32, s & 0xFFFFFFFF]``, which is ``jax.random.key(s)`` with x64 enabled. Key data
crosses to JAX as an int32 tensor of shape (2,) (the same bits; JAX reinterprets them as
uint32), because XLA graphs compiled from torch carry no uint32.
"""

from __future__ import annotations

import contextlib
import numbers
import operator
from typing import Iterator

import torch

from torch_pallas import bridge
from torch_pallas.ops.fold_in import fold_in

SEED_BOUND = 2**64


def check_seed(seed) -> int:
    """Returns ``seed`` as an int, or raises.

    Raises:
        TypeError: ``seed`` is not an integer (bool included).
        ValueError: ``seed`` is outside [0, 2**64).
    """
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an int in [0, 2**64), got {type(seed).__name__} {seed!r}")
    seed = operator.index(seed)
    if not 0 <= seed < SEED_BOUND:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    return seed


def signed_key_words(seed: int) -> tuple[int, int]:
    """The two key words of a checked ``seed`` as signed 32-bit ints."""
    high, low = seed >> 32, seed & 0xFFFFFFFF
    return tuple(word - 2**32 if word >= 2**31 else word for word in (high, low))


def key_data_from_seed(seed, device=None) -> torch.Tensor:
    """The int32 (2,) tensor of key data for ``seed``, on ``device`` (default CPU).

    Built from Python ints so that ``torch.compile`` folds it into the graph.
    """
    return torch.tensor(signed_key_words(check_seed(seed)), dtype=torch.int32, device=device)


def check_generator(generator) -> torch.Generator:
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    bridge.check_generator_device(generator)
    return generator


def check_source(seed=None, generator=None) -> None:
    """Checks where a key would come from, without drawing it (see :func:`key_data`)."""
    if seed is not None and generator is not None:
        raise ValueError("pass seed or generator, not both")
    if seed is not None:
        check_seed(seed)
    if generator is not None:
        check_generator(generator)


class RegionKey:
    """A key drawn the first time a random op inside a :func:`key_scope` of it asks for one, as
    that op would draw its own (from the RNG of its device, or the enclosing scope), and the
    same key ever after: a region that may hold no random op draws nothing."""

    def __init__(self):
        self.key_data: torch.Tensor | None = None


class _KeyScope:
    def __init__(self, key: torch.Tensor | RegionKey, depth: int):
        self.key, self.depth = key, depth
        self.draws = 0

    def next_key(self, device: torch.device) -> torch.Tensor:
        key = self.key
        if isinstance(key, RegionKey):
            if key.key_data is None:
                key.key_data = _scope_key(self.depth, device)
            key = key.key_data
        key = fold_in(key, self.draws)
        self.draws += 1
        return key


_key_scopes: list[_KeyScope] = []


def _scope_key(depth: int, device: torch.device) -> torch.Tensor:
    """A key drawn without a seed or generator from below the innermost ``depth`` scopes."""
    if depth:
        return _key_scopes[depth - 1].next_key(device).to(device)
    return bridge.draw_key_words(device)


@contextlib.contextmanager
def key_scope(key_data: torch.Tensor) -> Iterator[None]:
    """Within it, the ``i``-th key drawn without a seed or generator (counting from 0) is
    ``jax.random.fold_in(key, i)`` of ``key_data``'s key instead of a draw from the XLA RNG.

    What runs inside is then a pure function of ``key_data``: running it again with the
    same key gives the same noise, whatever the RNG did in between (this is how
    :func:`torch_pallas.checkpoint` makes a recomputation draw its forward's masks, as
    Flax folds module paths into keys). Scopes nest; the innermost one counts.

    Args:
        key_data (Tensor): int32 of shape (2,) on a device torch_pallas runs on, as
            :func:`key_data` returns; or a :class:`RegionKey`, drawn at the scope's first key.

    Raises:
        TypeError, ValueError: ``key_data`` is not an int32 (2,) tensor on such a device.
    """
    if not isinstance(key_data, RegionKey):
        if not isinstance(key_data, torch.Tensor) or key_data.dtype != torch.int32 or key_data.shape != (2,):
            raise TypeError(f"key_data must be an int32 tensor of shape (2,), got {key_data!r:.80}")
        bridge.check_device(key_data, "key_data")
    _key_scopes.append(_KeyScope(key_data, len(_key_scopes)))
    try:
        yield
    finally:
        _key_scopes.pop()


def key_data(*, seed=None, generator=None, device=None) -> torch.Tensor:
    """Key data (int32, shape (2,), on ``device``) for one random op, drawn as every random
    op draws its key (:ref:`where keys come from <key-sources>`):

    * ``seed``: an int in [0, 2**64); the same seed always gives the same key.
    * ``generator``: a CPU ``torch.Generator`` (with TorchTPU also a ``tpu`` one); two 32-bit
      words are drawn from it, on its device.
    * neither: inside a :func:`key_scope`, the scope's next derived key (moved to
      ``device``); otherwise two words drawn on ``device`` from its RNG (on an XLA device
      with no host sync and no new graph per call).

    ``device``: a device torch_pallas runs on (:ref:`devices`); default the stack's device.

    Raises:
        ValueError: both ``seed`` and ``generator`` given, a seed out of range, a
            generator on a device other than the CPU (and with TorchTPU ``tpu``), or a device
            torch_pallas does not run on.
        TypeError: a non-integer seed or a non-Generator ``generator``.
    """
    device = bridge.device_or_default(device)
    check_source(seed, generator)
    return draw(seed, generator, device)


def draw(seed, generator, device: torch.device) -> torch.Tensor:
    """:func:`key_data` of a checked source (:func:`check_source`) on a checked device."""
    if seed is not None:
        return key_data_from_seed(seed, device)
    if generator is not None:
        return bridge.torch_key_words(generator=generator).to(device)
    return _scope_key(len(_key_scopes), device)
