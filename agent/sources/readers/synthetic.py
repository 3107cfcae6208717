"""The synthetic source: generated inputs at a fixed rate, for trying a model and measuring
the agent without a camera."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from agent.models.backends.base import Array, TensorSpec
from agent.sources.base import FIELD, ReaderContext, Record


class SyntheticReader:
    """Generated inputs at `rate_hz`: the model's inputs (symbolic dims 1), or uint8 frames
    of `frame_shape` that go through the model's preprocessing like camera frames."""

    def __init__(self, ctx: ReaderContext, specs: Sequence[TensorSpec]) -> None:
        self.ctx = ctx
        config = ctx.config
        assert config.rate_hz is not None
        self.period = 1.0 / config.rate_hz
        self.random = config.fill == "random"
        self.rng = np.random.default_rng()
        if config.frame_shape is not None:
            self.shapes = {FIELD: (tuple(config.frame_shape), np.dtype(np.uint8))}
        else:
            self.shapes = {
                s.name: (tuple(d if isinstance(d, int) and d >= 0 else 1 for d in s.shape), s.dtype)
                for s in specs
            }
        self.fixed = {
            name: self._zeros(shape, dtype) for name, (shape, dtype) in self.shapes.items()
        }

    @staticmethod
    def _zeros(shape: tuple[int, ...], dtype: np.dtype[Any]) -> Array:
        array = np.zeros(shape, dtype=dtype)
        array.flags.writeable = False  # shared by every frame: nobody may change it
        return array

    def _generate(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> Array:
        if dtype.kind == "f":
            return self.rng.standard_normal(shape, dtype=np.float32).astype(dtype, copy=False)
        if dtype.kind == "b":
            return self.rng.integers(0, 2, shape, dtype=np.uint8).astype(np.bool_)
        if dtype == np.uint8:
            return self.rng.integers(0, 256, shape, dtype=np.uint8)
        return self.rng.integers(0, 10, shape).astype(dtype)

    def records(self) -> Iterator[Record]:
        stop = self.ctx.stop_event
        prepared = self.ctx.config.frame_shape is None
        next_at = time.monotonic()
        while not stop.is_set():
            delay = next_at - time.monotonic()
            if delay > 0:
                if stop.wait(delay):
                    return
            elif delay < -2 * self.period:
                next_at = time.monotonic()  # fell behind (a stall): no burst to catch up
            next_at += self.period
            if self.random:
                fields = {n: self._generate(shape, dt) for n, (shape, dt) in self.shapes.items()}
            else:
                fields = dict(self.fixed)
            yield Record(fields, prepared=prepared)

    def close(self) -> None:
        pass
