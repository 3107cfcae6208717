"""Reuse: the prefix cache and prompt lookup (decisions 0053, 0054) against the plain generate
loop, on the bundled GPT-2-like decoder (tests/fixtures/real/decoders/gpt2, models/writer).

Both run the agent's own generate strategy (`agent.inference.generate`) over one ONNX Runtime
session in this process, with the agent's session options, no MQTT: what they change is the
model's runs, not the delivery. Rounds alternate between the two settings; the figures are the
medians.

- Time to the first token of a prompt whose first `SHARED` tokens an earlier request asked
  too (a system prompt; a chat's earlier turns): `[generate] prefix_cache_mb` off, then on.
- Tokens/s of greedy generation from seeded random prompts, `prompt_lookup` 0 and 10, and the
  tokens a run gave. The bundled decoder's text rarely repeats itself, so this row shows the
  cost where guesses seldom hold; where output copies its prompt, a run gives up to 11.

    python benchmarks/reuse.py [--quick]     # this section alone, printed
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from agent.demo.broker import EmbeddedBroker  # noqa: E402
from benchmarks.harness import section_main  # noqa: E402

FIXTURE = REPO / "tests" / "fixtures" / "real" / "decoders" / "gpt2"
SHARED, NEW = 96, 8  # the prompt's shared beginning and its own tokens (context 128)
LOOKUP, TOKENS, PROMPT = 10, 100, 12  # guesses a run; tokens and prompt ids a generation
THREADS = 1  # as the agent's default of one intra-op thread a worker on 2 cores


@dataclass
class ReuseResult:
    first_token_ms: float  # prefix cache off
    cached_first_token_ms: float  # on: the shared beginning from the cache
    cached_tokens: int
    tokens_s: float  # prompt_lookup 0
    lookup_tokens_s: float  # prompt_lookup LOOKUP
    tokens_a_run: float  # with LOOKUP: the tokens over the model's runs
    rounds: int


def _setup(cache_mb: int) -> tuple[Any, Any]:
    from agent.models.backends.base import BackendOptions
    from agent.models.backends.onnxruntime import OnnxRuntimeBackend
    from agent.models.decoder_layout import open_generation
    from agent.models.generate_config import GenerateConfig

    session = OnnxRuntimeBackend().load(FIXTURE / "model.onnx", BackendOptions(THREADS))
    setup = open_generation(GenerateConfig(prefix_cache_mb=cache_mb), session, FIXTURE)
    return session, setup


def _generate(session: Any, setup: Any, ids: list[int], params: dict[str, Any]) -> Any:
    """One generation of `ids` to its end: (the ask, s to the first token, s in all, runs)."""
    from agent.inference import generate
    from agent.inference.modes import Member, Run
    from agent.models.model_config import StreamConfig

    ask = generate.ask_of({"input_ids": np.array(ids)}, params, setup)
    run = Run(session, StreamConfig(mode="generate"), [Member({}, 1, generation=ask)])
    started = time.perf_counter()
    steps = generate.generate(run)
    next(steps)
    first = time.perf_counter() - started
    for _ in steps:
        pass
    return ask, first, time.perf_counter() - started, run.runs


def measure(broker: EmbeddedBroker, workdir: Path, quick: bool) -> ReuseResult:
    del broker, workdir  # in this process: no agent, no MQTT
    rounds = 5 if quick else 40
    rng = np.random.default_rng(0)
    plain, cached = _setup(0), _setup(64)
    shared = rng.integers(1, 384, SHARED).tolist()
    _generate(*cached, shared + [1] * NEW, {"max_new_tokens": 1})  # the earlier request
    firsts: dict[bool, list[float]] = {False: [], True: []}
    held = 0
    for _ in range(rounds):
        ids = shared + rng.integers(1, 384, NEW).tolist()
        for on, (session, setup) in ((False, plain), (True, cached)):
            ask, first, _, _ = _generate(session, setup, ids, {"max_new_tokens": 1})
            firsts[on].append(first * 1000)
            held = ask.cached_tokens if on else held
    rates: dict[int, list[float]] = {0: [], LOOKUP: []}
    made = runs = 0
    for _ in range(rounds):
        ids = rng.integers(1, 384, PROMPT).tolist()
        for lookup in (0, LOOKUP):
            params = {"max_new_tokens": TOKENS, "prompt_lookup": lookup}
            ask, _, took, ran = _generate(*plain, ids, params)
            rates[lookup].append(len(ask.tokens) / took)
            if lookup:
                made, runs = made + len(ask.tokens), runs + ran
    med = statistics.median
    return ReuseResult(
        med(firsts[False]),
        med(firsts[True]),
        held,
        med(rates[0]),
        med(rates[LOOKUP]),
        made / runs,
        rounds,
    )


def to_json(result: ReuseResult) -> dict[str, Any]:
    return asdict(result)


def from_json(data: dict[str, Any]) -> ReuseResult:
    return ReuseResult(**data)


def met(result: ReuseResult) -> bool:
    return True  # reported, no target


def section(result: ReuseResult) -> list[str]:
    speedup = result.first_token_ms / result.cached_first_token_ms
    lookup = result.lookup_tokens_s / result.tokens_s
    return [
        "## Reuse: the prefix cache and prompt lookup",
        "",
        "The agent's generate strategy on the bundled GPT-2-like decoder in the benchmark's "
        f"process (one intra-op thread, no MQTT), {result.rounds} rounds alternating the two "
        "settings, medians (decisions 0053, 0054). No target: these say what the two "
        "settings change.",
        "",
        "| | off | on | figure |",
        "|---|---|---|---|",
        f"| time to first token (ms), {SHARED} shared + {NEW} new prompt tokens, "
        f"`prefix_cache_mb` | {result.first_token_ms:.2f} | {result.cached_first_token_ms:.2f} | "
        f"x{speedup:.1f} faster, {result.cached_tokens} tokens from the cache |",
        f"| tokens/s, {TOKENS} tokens from random {PROMPT}-token prompts, `prompt_lookup` "
        f"{LOOKUP} | {result.tokens_s:.0f} | {result.lookup_tokens_s:.0f} | x{lookup:.2f}, "
        f"{result.tokens_a_run:.2f} tokens a run |",
        "",
    ]


def main(argv: list[str] | None = None) -> int:
    return section_main(__doc__, "edge-bench-reuse-", measure, section, met, argv)


if __name__ == "__main__":
    raise SystemExit(main())
