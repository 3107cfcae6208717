"""A decoder's cache kept after a generation, so that a later prompt that begins the same way
skips the runs of what they share (`[generate] prefix_cache_mb`).

A chat on the box sends its whole conversation every turn, and a system prompt or few-shot
examples open every request: without this, each request runs its whole prompt through the
model again before its first token. The store keeps, per version, the cache of recent
generations (their `present.*` arrays as the session returned them: no copy) with the token
ids it holds; a new prompt takes the longest shared beginning of any entry, cut to one token
short of the prompt (the prompt's last token must run to give the first logits), and runs only
the rest (`agent.inference.generate`). This is llama.cpp's `cache_prompt` and vLLM's prefix
caching, for one box: a decoder alone (not an encoder-decoder), the least recently used entries
dropped past the size bound. On the host the entries are numpy arrays, cut by numpy; on ONNX
Runtime's GPU provider they are the runtime's values on the device, cut there
(`backends.base.DeviceCut`). Thread-safe: the workers of one version share it.

Imports only `backends.base`.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from agent.models.backends.base import DeviceCut

__all__ = ["PrefixCache", "PrefixHit", "cut_past"]

Arrays = Mapping[str, Any]  # numpy arrays, or a device session's values
MIN_SHARED = 4  # fewer shared tokens than this: a fresh prefill (the cut costs about as much)


@dataclass(frozen=True)
class PrefixHit:
    """The cache of the first `tokens` ids of a prompt, one array per cache input."""

    tokens: int
    cache: dict[str, Any]


@dataclass(frozen=True)
class _Entry:
    ids: tuple[int, ...]
    cache: dict[str, Any]  # cache input name -> the output that held it
    nbytes: int


class PrefixCache:
    """Recent generations' caches of one version, at most `max_bytes` of them. `slots`: each
    cache input's past axis and item size; `device`: the session that cuts values kept on
    its device (None: numpy arrays on the host)."""

    def __init__(
        self, max_bytes: int, slots: Mapping[str, tuple[int, int]], device: DeviceCut | None
    ) -> None:
        self.max_bytes = max_bytes
        self._past_axes = {name: axis for name, (axis, _) in slots.items()}
        self._item_sizes = {name: size for name, (_, size) in slots.items()}
        self._device = device
        self._entries: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()
        self._bytes = 0
        self.tokens_served = 0  # prompt tokens taken from the cache since load (a counter)
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def keep(self, ids: Sequence[int], cache: Arrays) -> None:
        """Keeps `cache` (cache input name -> an array holding `ids`, batch 1) for later
        prompts; an entry whose ids begin these is dropped (this one holds more)."""
        key = tuple(ids)
        arrays = {name: cache[name] for name in self._past_axes}
        shapes = {name: _shape(value) for name, value in arrays.items()}
        if any(s[0] != 1 or s[self._past_axes[n]] != len(key) for n, s in shapes.items()):
            return  # not one row holding exactly `ids` (a caller's slip: keep nothing)
        nbytes = sum(math.prod(s) * self._item_sizes[n] for n, s in shapes.items())
        if nbytes > self.max_bytes or len(key) < MIN_SHARED:
            return
        with self._lock:
            for old in [k for k in self._entries if k == key[: len(k)]]:
                self._bytes -= self._entries.pop(old).nbytes
            self._entries[key] = _Entry(key, arrays, nbytes)
            self._bytes += nbytes
            while self._bytes > self.max_bytes:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= dropped.nbytes

    def longest(self, ids: Sequence[int]) -> PrefixHit | None:
        """The cache of the longest beginning of `ids` an entry holds, one token short of
        `ids` at most; None where no entry shares `MIN_SHARED` tokens."""
        with self._lock:
            best: _Entry | None = None
            shared = 0
            for entry in self._entries.values():
                n = _shared(entry.ids, ids, len(ids) - 1)
                if n > shared:
                    best, shared = entry, n
            if best is None or shared < MIN_SHARED:
                return None
            self._entries.move_to_end(best.ids)
            self.tokens_served += shared
        cache = {name: self._cut(name, array, shared) for name, array in best.cache.items()}
        return PrefixHit(shared, cache)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def _cut(self, name: str, array: Any, tokens: int) -> Any:
        """`array`'s first `tokens` along its past axis (the entry stays as it was)."""
        return cut_past(array, self._past_axes[name], tokens, self._device)


def cut_past(array: Any, axis: int, tokens: int, device: DeviceCut | None) -> Any:
    """A cache tensor's first `tokens` along its past `axis`: the array itself where it holds
    no more, else a contiguous copy; a value kept on the device is cut there, by `device`."""
    if _shape(array)[axis] == tokens:
        return array
    if not isinstance(array, np.ndarray):
        assert device is not None  # only a device session's values are not arrays
        return device.cut_kept(array, axis, tokens)
    index = tuple(slice(0, tokens) if a == axis else slice(None) for a in range(array.ndim))
    return np.ascontiguousarray(array[index])


def _shape(value: Any) -> tuple[int, ...]:
    """A numpy array's shape, or an ONNX Runtime value's (`OrtValue.shape()`)."""
    if isinstance(value, np.ndarray):
        return tuple(value.shape)
    return tuple(value.shape())


def _shared(kept: tuple[int, ...], ids: Sequence[int], most: int) -> int:
    """How many first ids `kept` and `ids` share, at most `most`."""
    n = 0
    for a, b in zip(kept, ids[:most], strict=False):
        if a != b:
            break
        n += 1
    return n
