"""Which optimization profile of a TensorRT engine an execution context runs a request under.

An engine built with dynamic shapes has one or more optimization profiles, each a (min, opt,
max) range of every input's shape. A context keeps the profile it last ran under while the
request's shapes fit it, and switches (`set_optimization_profile_async`) to the first that
fits otherwise. Before TensorRT 8.6 a profile may be used by one live context at a time, so
there a context claims its profile and others pick another that fits.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from agent.models.backends.base import InferenceError
from agent.models.backends.tensorrt.runtime import one_line
from agent.models.backends.tensorrt.tensors import EngineTensor, Shape, ShapeRange

__all__ = ["Profiled", "Profiles"]


class Profiled(Protocol):
    """An execution context and the profile it runs under (None: not chosen yet)."""

    context: Any
    profile: int | None


class Profiles:
    """The engine's profiles, and (before TensorRT 8.6) which context holds which."""

    def __init__(
        self,
        inputs: Sequence[EngineTensor],
        *,
        exclusive: bool,
        version: str,
        failure: Callable[[str], InferenceError],
    ) -> None:
        """`exclusive`: one context a profile (TensorRT before 8.6); `failure`: an
        InferenceError for a refusal, with what TensorRT logged about it."""
        self._in = tuple(inputs)
        self.count = len(self._in[0].profiles)
        self._exclusive = exclusive
        self._version = version
        self._failure = failure
        self._lock = threading.Lock()
        self._claims: dict[int, Profiled] = {}  # profile -> its context (exclusive only)

    def ranges(self) -> tuple[dict[str, ShapeRange], ...]:
        """(min, opt, max) of every input, per optimization profile."""
        return tuple({t.name: t.profiles[p] for t in self._in} for p in range(self.count))

    def select(self, worker: Profiled, shapes: Mapping[str, Shape], stream: Any) -> None:
        """Keep the context's profile when it admits the shapes, else switch to one that does."""
        admitting = self._admitting(shapes)
        if not admitting:
            given = ", ".join(f"{n} {list(s)}" for n, s in shapes.items())
            raise InferenceError(
                f"input shapes ({given}) fit no optimization profile ({self._describe()})"
            )
        if worker.profile in admitting:
            return
        profile = self._claim(worker, admitting)
        try:
            switched = worker.context.set_optimization_profile_async(profile, stream.handle)
        except RuntimeError as exc:
            self._unclaim(worker, profile)
            raise self._failure(f"optimization profile {profile}: {one_line(exc)}") from exc
        if not switched:
            self._unclaim(worker, profile)
            raise self._failure(f"optimization profile {profile} refused")
        if worker.profile is not None:
            self._unclaim(worker, worker.profile)
        worker.profile = profile

    def forget(self, worker: Profiled) -> None:
        """A context gone: the profiles it held are free."""
        with self._lock:
            for profile in [p for p, w in self._claims.items() if w is worker]:
                del self._claims[profile]

    def clear(self) -> None:
        with self._lock:
            self._claims.clear()

    def _admitting(self, shapes: Mapping[str, Shape]) -> list[int]:
        def fits(profile: int) -> bool:
            for t in self._in:
                low, _, high = t.profiles[profile]
                shape = shapes[t.name]
                if any(not lo <= s <= hi for lo, s, hi in zip(low, shape, high, strict=True)):
                    return False
            return True

        return [p for p in range(self.count) if fits(p)]

    def _describe(self) -> str:
        parts = []
        for p in range(self.count):
            ranges = ", ".join(
                f"{t.name} {list(t.profiles[p][0])}..{list(t.profiles[p][2])}" for t in self._in
            )
            parts.append(f"profile {p}: {ranges}")
        return "; ".join(parts)

    def _claim(self, worker: Profiled, admitting: Sequence[int]) -> int:
        """The profile to use; before TensorRT 8.6 one that no other context holds."""
        if not self._exclusive:
            return admitting[0]
        with self._lock:
            for profile in admitting:
                if self._claims.get(profile, worker) is worker:
                    self._claims[profile] = worker
                    return profile
        raise InferenceError(
            f"optimization profile(s) {list(admitting)} are held by other workers' contexts; "
            f"TensorRT {self._version} lets one context use a profile at a time: build the "
            "engine with one profile per worker"
        )

    def _unclaim(self, worker: Profiled, profile: int) -> None:
        with self._lock:
            if self._claims.get(profile) is worker:
                del self._claims[profile]
