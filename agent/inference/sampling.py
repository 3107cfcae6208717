"""Choosing the next token from a decoder's logits, outside the graph.

Greedy (the arg max, Hugging Face's `do_sample=False`) unless `params.temperature` > 0; then
the logits are divided by the temperature, cut to the `top_k` best and to the smallest set
whose probability reaches `top_p`, and a token is drawn from what is left with numpy's
generator seeded by `params.seed` (the same seed gives the same tokens). A request that names no
seed gets one made from its id (`replayable`): a stored request run again after a crash samples
the tokens it sampled before, so the messages its subscriber kept by (id, seq) still agree.
`repetition_penalty` (CTRL's, as `transformers` applies it) divides the positive logits of
tokens already in the prompt or the output by the penalty and multiplies the negative ones,
before either rule. Hand-written: a few numpy lines, where a library would add a framework.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from agent.inference.modes import integer_param
from agent.protocol.errors import WireError

__all__ = ["Sampler", "SamplingParams", "replayable"]


def replayable(params: Mapping[str, Any], request_id: str) -> Mapping[str, Any]:
    """`params`, with a `seed` made from `request_id` where they sample and name none."""
    temperature = params.get("temperature")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        return params  # greedy (or not a number: `SamplingParams.parse` says so)
    if temperature <= 0 or params.get("seed") is not None:
        return params
    digest = hashlib.blake2b(request_id.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return {**params, "seed": int.from_bytes(digest, "big") >> 1}  # within 2**63 - 1


MAX_TOP_K = 1 << 20
_LARGEST = float(np.finfo(np.float64).max)


@dataclass(frozen=True)
class SamplingParams:
    """The sampling params of one request, checked."""

    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = None
    repetition_penalty: float = 1.0

    @classmethod
    def parse(cls, params: Mapping[str, Any], penalty: float = 1.0) -> SamplingParams:
        """`params` checked; `penalty`: `repetition_penalty` where they leave it out (the
        model's `generation_config.json`'s)."""
        temperature = _number(params, "temperature", 0.0, low=0.0, high=100.0)
        top_p = _number(params, "top_p", 1.0, low=0.0, high=1.0, open_low=True)
        penalty = _number(params, "repetition_penalty", penalty, low=0.0, high=100.0, open_low=True)
        top_k = integer_param(params, "top_k", 0, high=MAX_TOP_K)
        seed = params.get("seed")
        if seed is not None:
            seed = integer_param(params, "seed", 0, high=2**63 - 1)
        return cls(temperature, top_k, top_p, seed, penalty)


class Sampler:
    """One request's token choice (its own random generator, the tokens it has seen)."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._rng = np.random.default_rng(params.seed) if params.temperature > 0 else None
        self._penalised = params.repetition_penalty != 1.0
        self._seen: dict[int, None] = {}  # the tokens so far, once each (penalty only)
        self._seen_ids = np.zeros((0,), dtype=np.int64)

    def see(self, tokens: Iterable[int]) -> None:
        """Note tokens of the prompt or the output (what `repetition_penalty` lowers)."""
        if not self._penalised:
            return
        grown = len(self._seen)
        self._seen.update(dict.fromkeys(tokens))
        if len(self._seen) != grown:
            self._seen_ids = np.fromiter(self._seen, dtype=np.int64, count=len(self._seen))

    def choose(self, logits: np.ndarray[Any, Any], history: Iterable[int] = ()) -> int:
        """The next token from one row of logits (`[vocab]`); `history`: tokens not yet seen
        (`see`) that the penalty should count. Greedy without a penalty reads the row as it
        is: no copy, no float64."""
        params = self.params
        self.see(history)
        if not self._penalised and self._rng is None:
            return int(logits.argmax())
        scores = logits.astype(np.float64, copy=True)
        if self._penalised and self._seen:
            seen = self._seen_ids[(self._seen_ids >= 0) & (self._seen_ids < scores.shape[0])]
            picked = scores[seen]
            with np.errstate(over="ignore"):  # a tiny penalty: the seen tokens go to +-inf
                scores[seen] = np.where(
                    picked > 0,
                    picked / params.repetition_penalty,
                    picked * params.repetition_penalty,
                )
        if self._rng is None:
            return int(np.argmax(scores))
        # A tiny penalty or temperature overflows. The best score is taken off first (NaN and
        # +inf made finite, so no inf - inf), so the best token stays at 0 and the others go
        # to -inf, as they do at the limit: greedy's token.
        scores = np.nan_to_num(scores, nan=-np.inf, posinf=_LARGEST, neginf=-np.inf)
        with np.errstate(over="ignore", invalid="ignore"):
            scaled = (scores - scores.max()) / params.temperature
        return self._draw(np.nan_to_num(scaled, nan=-np.inf))

    def _draw(self, scores: np.ndarray[Any, Any]) -> int:
        assert self._rng is not None
        params = self.params
        order = np.argsort(-scores, kind="stable")
        if params.top_k:
            order = order[: params.top_k]
        kept = scores[order]
        if not np.isfinite(kept[0]):
            return int(order[0])  # nothing to draw from (every score masked, or NaN)
        with np.errstate(invalid="ignore", over="ignore"):
            probs = np.exp(kept - kept[0])
        probs /= probs.sum()
        if params.top_p < 1.0:
            reach = int(np.searchsorted(np.cumsum(probs), params.top_p)) + 1
            order, probs = order[:reach], probs[:reach] / probs[:reach].sum()
        return int(order[self._rng.choice(len(order), p=probs)])


def _number(
    params: Mapping[str, Any],
    key: str,
    default: float,
    *,
    low: float,
    high: float,
    open_low: bool = False,
) -> float:
    value = params.get(key, default)
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if ok:
        value = float(value)
        ok = (value > low if open_low else value >= low) and value <= high
    if not ok:
        side = ">" if open_low else ">="
        raise WireError("bad_request", f"params.{key} must be a number {side} {low} and <= {high}")
    return float(value)
