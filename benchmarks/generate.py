"""Generate: one token stream of the bundled GPT-2-like decoder through the agent against a
bare ONNX Runtime greedy loop over the same file.

The agent side is one `mode = "generate"` request (`max_new_tokens` tokens, one chunk each),
counted by `mosquitto_sub` (a Python subscriber took as much of the 2-core box's CPU a token as
the agent's whole path): its rate from the chunks' arrival times, first to last, its time to
first token from the `end`'s `timing.ttft_ms` (request read to first token chosen). "Bare" is
`InferenceSession.run` in this process, with the session options the agent gives its sessions
(same threads, sequential, all graph optimisations): the prefill, then one run per token with
the cache fed back, the arg max taken with numpy; the figure is the agent's rate against it,
and its time to first token against the bare prefill alone. A third rate, "generate loop", is
the agent's own generate strategy (`agent.inference.generate`, text decoding included) driving
a session in this process with no MQTT: what generation costs on top of the model, apart from
what delivering a chunk costs. A fourth, "lean loop", is that loop publishing each token's chunk
itself with no agent (benchmarks/lean_loop.py): a reference for what a chunk a token costs any
Python publisher here.

    python benchmarks/generate.py [--quick]     # this section alone, printed
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from agent.demo.broker import EmbeddedBroker  # noqa: E402
from benchmarks.harness import (  # noqa: E402
    AgentProcess,
    PayloadSubscriber,
    close_client,
    mqtt_client,
    one_request,
    section_main,
    unique_id,
    wait_online,
)
from benchmarks.lean_loop import LeanPublisher  # noqa: E402

FIXTURE = REPO / "tests" / "fixtures" / "real" / "decoders" / "gpt2"
TARGET_RATIO, TARGET_TTFT_MS = 0.9, 2.0
CPU, CUDA = "CPUExecutionProvider", "CUDAExecutionProvider"
CONCURRENT = 4
BATCHING = f"[batching]\nmax_batch = {CONCURRENT}\nmax_queue_delay_us = 20000\n"
PROMPTS = ["The little robot", "Edge boxes stream tokens", "日本語 café 🙂", "Once upon a time"]
PROMPT = "The little robot"


@dataclass
class GenerateResult:
    tokens: int
    agent_tokens_s: float
    bare_tokens_s: float
    agent_ttft_ms: float
    bare_prefill_ms: float
    loop_tokens_s: float  # the generate strategy alone (no MQTT)
    provider: str = CPU
    # agent / bare of each round (the two measured one after the other): their median is the
    # figure, as in the one-stream section, so that the VM's drift falls on both
    round_ratios: list[float] = field(default_factory=list)
    # CONCURRENT requests at once, tokens/s of them all: the model alone / with `[batching]`
    # (their steps in lock-step), medians of alternating bursts; 0: not measured
    concurrent_tokens_s: float = 0.0
    batched_tokens_s: float = 0.0
    # The generate strategy publishing each token's chunk itself, no agent (benchmarks/
    # lean_loop.py): its tokens/s and the median of each round's lean / bare; 0: not measured
    lean_tokens_s: float = 0.0
    lean_ratio: float = 0.0
    # The same on ONNX Runtime's CUDA provider, where this onnxruntime has one (a GPU box)
    cuda: GenerateResult | None = None

    @property
    def ratio(self) -> float:
        if self.round_ratios:
            return statistics.median(self.round_ratios)
        return self.agent_tokens_s / self.bare_tokens_s

    @property
    def ttft_over_ms(self) -> float:
        return self.agent_ttft_ms - self.bare_prefill_ms


def providers(provider: str) -> list[str]:
    """`provider`, the CPU's behind it (once)."""
    return list(dict.fromkeys((provider, CPU)))


def bare_session(threads: int, provider: str = CPU) -> Any:
    """An ONNX Runtime session of the fixture with the options the agent's backend sets
    (`agent.models.backends.onnxruntime`), on `provider` (the CPU's behind it)."""
    import onnxruntime as ort

    from agent.models.backends.base import BackendOptions
    from agent.models.backends.onnxruntime import OnnxRuntimeBackend

    opts = OnnxRuntimeBackend._session_options(ort, BackendOptions(threads))
    return ort.InferenceSession(str(FIXTURE / "model.onnx"), opts, providers=providers(provider))


def bare_loop(session: Any, tokens: int, prompt: list[int]) -> tuple[float, float]:
    """(tokens/s of the one-token runs, prefill ms) of a plain greedy loop."""
    names = [a.name for a in session.get_inputs()]
    outs = [o.name for o in session.get_outputs()]
    pasts = [n for n in names if n.startswith("past_key_values.")]
    # [batch, kv heads, past, head size]: the numbers the export fixed, batch 1, past 0
    past_shapes = {
        a.name: (1, a.shape[1], 0, a.shape[3]) for a in session.get_inputs() if a.name in pasts
    }
    positions = "position_ids" in names
    feed: dict[str, Any] = {"input_ids": np.array([prompt], np.int64)}
    feed["attention_mask"] = np.ones((1, len(prompt)), np.int64)
    if positions:
        feed["position_ids"] = np.arange(len(prompt), dtype=np.int64)[None]
    for name in pasts:
        feed[name] = np.zeros(past_shapes[name], np.float32)
    started = time.perf_counter()
    result = dict(zip(outs, session.run(None, feed), strict=True))
    prefill = time.perf_counter() - started
    steps_started = time.perf_counter()
    past = len(prompt)
    for _ in range(tokens - 1):
        token = int(np.argmax(result["logits"][0, -1]))
        feed = {"input_ids": np.array([[token]], np.int64)}
        feed["attention_mask"] = np.ones((1, past + 1), np.int64)
        if positions:
            feed["position_ids"] = np.array([[past]], np.int64)
        for name in pasts:
            feed[name] = result[name.replace("past_key_values", "present")]
        result = dict(zip(outs, session.run(None, feed), strict=True))
        past += 1
    return (tokens - 1) / (time.perf_counter() - steps_started), prefill * 1000


def generate_loop(
    threads: int, tokens: int, provider: str = CPU
) -> Callable[[LeanPublisher | None], float]:
    """A function giving the tokens/s of the one-token steps of the agent's generate strategy
    over a session of the fixture, no agent around it: given no publisher the pieces are
    made and dropped (no MQTT), given one each becomes a chunk it publishes (the lean row)."""
    from agent.inference import generate
    from agent.inference.modes import Member, Run
    from agent.models.backends.base import BackendOptions
    from agent.models.backends.onnxruntime import OnnxRuntimeBackend
    from agent.models.decoder_layout import open_generation
    from agent.models.model_config import StreamConfig

    options = BackendOptions(threads, tuple(providers(provider)))
    session = OnnxRuntimeBackend().load(FIXTURE / "model.onnx", options)
    setup = open_generation(None, session, FIXTURE)
    prompt = np.array(PROMPT, dtype=object)

    def publish(publisher: LeanPublisher | None, pieces: list[Any]) -> None:
        if publisher is None:
            return
        for piece in pieces:
            publisher.chunk(piece.index, piece.outputs, **(piece.extra or {}))

    def rate(publisher: LeanPublisher | None = None) -> float:
        ask = generate.ask_of({"prompt": prompt}, {"max_new_tokens": tokens}, setup)
        steps = generate.generate(
            Run(session, StreamConfig(mode="generate"), [Member({}, 1, generation=ask)])
        )
        publish(publisher, next(steps))  # the prefill and the first token
        started = time.perf_counter()
        made = 0
        for pieces in steps:
            publish(publisher, pieces)
            made += 1
        if publisher is not None:
            publisher.end()
        return made / (time.perf_counter() - started)

    return rate


def measure(broker: EmbeddedBroker, workdir: Path, quick: bool) -> GenerateResult:
    """On the CPU, then on the CUDA provider where this onnxruntime has one."""
    import onnxruntime as ort

    root = workdir / "models"
    for name, extra in (("writer", ""), ("writer_batched", BATCHING)):
        shutil.copytree(FIXTURE, root / name / "1")
        (root / name / "config.toml").write_text('[stream]\nmode = "generate"\n' + extra)
    result = measure_on(broker, workdir, root, quick, CPU)
    if CUDA in ort.get_available_providers():
        result.cuda = measure_on(broker, workdir, root, quick, CUDA)
    return result


def measure_on(
    broker: EmbeddedBroker, workdir: Path, root: Path, quick: bool, provider: str
) -> GenerateResult:
    """The agent as its own process (`edge-agent run`, as on a box), its stream counted by a C
    subscriber: neither takes interpreter time from the agent's worker; the agent, the bare
    loop and the generate loop on `provider` (the CPU's behind it)."""
    from agent.config.loading import load_config
    from agent.models.tokenizer import open_tokenizer
    from agent.service.agent import intra_op_threads

    tokens = 64 if quick else 100
    tokenizer = open_tokenizer(FIXTURE)
    assert tokenizer is not None
    prompt_ids = list(tokenizer.encode(PROMPT))
    rates, ttfts, bare_rates, prefills, loop_rates = [], [], [], [], []
    lean_rates, lean_ratios = [], []
    env = {"EDGE_AGENT__MODELS__PROVIDERS": json.dumps(providers(provider))}
    name = "bench-generate" if provider == CPU else "bench-generate-gpu"
    with AgentProcess(workdir, broker, root, device_id=name, env=env) as agent:
        threads = intra_op_threads(load_config(agent.config, environ={}))
        session = bare_session(threads, provider)
        loop = generate_loop(threads, tokens, provider)
        wait_online(broker, agent.root, agent.started)
        stream(broker, agent.root, tokens)  # warm
        publisher = LeanPublisher(broker, workdir)
        try:
            loop(publisher)  # warm
            for _ in range(5 if quick else 60):  # 60: this VM's speed moves in phases of seconds
                rate, ttft = stream(broker, agent.root, tokens)
                rates.append(rate)
                ttfts.append(ttft)
                rate, prefill = bare_loop(session, tokens, prompt_ids)
                bare_rates.append(rate)
                prefills.append(prefill)
                loop_rates.append(loop(None))
                lean_rates.append(loop(publisher))
                lean_ratios.append(lean_rates[-1] / rate)
        finally:
            publisher.close()
        alone, batched = concurrent_rates(broker, agent.root, tokens, 3 if quick else 8)
    med = statistics.median
    ratios = [agent / bare for agent, bare in zip(rates, bare_rates, strict=True)]
    return GenerateResult(
        tokens,
        med(rates),
        med(bare_rates),
        med(ttfts),
        med(prefills),
        med(loop_rates),
        provider,
        round_ratios=[round(r, 3) for r in ratios],
        concurrent_tokens_s=alone,
        batched_tokens_s=batched,
        lean_tokens_s=med(lean_rates),
        lean_ratio=med(lean_ratios),
    )


def concurrent_rates(
    broker: EmbeddedBroker, root: str, tokens: int, rounds: int
) -> tuple[float, float]:
    """Tokens/s of CONCURRENT requests published at once, all their chunks counted by one C
    subscriber from the first arrival to the last: to `writer`, then to `writer_batched`
    (the same file with `[batching]`), alternating; the medians."""
    rates: dict[str, list[float]] = {"writer": [], "writer_batched": []}
    for n in range(rounds + 1):  # the first warms
        for model in ("writer", "writer_batched") if n % 2 else ("writer_batched", "writer"):
            rate = burst(broker, root, model, tokens)
            if n:
                rates[model].append(rate)
    return statistics.median(rates["writer"]), statistics.median(rates["writer_batched"])


def burst(broker: EmbeddedBroker, root: str, model: str, tokens: int) -> float:
    from agent.protocol.payload import encode_payload

    expect = CONCURRENT * (tokens + 1)
    subscriber = PayloadSubscriber(broker, f"{root}/result/{model}/+", 1, expect=expect)
    client = mqtt_client(broker)
    try:
        for prompt in PROMPTS[:CONCURRENT]:
            body = {
                "id": unique_id("burst"),
                "inputs": {"prompt": np.array(prompt, dtype=object)},
                "params": {"max_new_tokens": tokens},
            }
            client.publish(f"{root}/infer/{model}", encode_payload(body), 1)
        if not subscriber.wait_for(expect, 120):
            raise RuntimeError(f"{model}: {subscriber.count} of {expect} messages arrived")
    finally:
        close_client(client)
        subscriber.close()
    times = subscriber.times()
    return (CONCURRENT * tokens - 1) / (times[-1] - times[0])


def stream(broker: EmbeddedBroker, root: str, tokens: int) -> tuple[float, float]:
    """(tokens/s between the first and the last chunk's arrival at `mosquitto_sub`, the `end`'s
    time to first token in ms) of one `tokens`-token request for the prompt's text."""
    body = {
        "id": unique_id("gen"),
        "inputs": {"prompt": np.array(PROMPT, dtype=object)},
        "params": {"max_new_tokens": tokens},
    }
    subscriber = one_request(broker, root, "writer", body, tokens + 1)
    arrived = subscriber.times()[:tokens]
    end = subscriber.bodies()[-1]
    assert end.get("type") == "end", end.get("type")
    return (tokens - 1) / (arrived[-1] - arrived[0]), float(end["timing"]["ttft_ms"])


def to_json(result: GenerateResult) -> dict[str, Any]:
    return asdict(result)


def from_json(data: dict[str, Any]) -> GenerateResult:
    cuda = data.get("cuda")
    return GenerateResult(**{**data, "cuda": from_json(cuda) if cuda else None})


def met(result: GenerateResult) -> bool:
    ok = result.ratio >= TARGET_RATIO and result.ttft_over_ms <= TARGET_TTFT_MS
    return ok and (result.cuda is None or met(result.cuda))


def headline(result: GenerateResult) -> str:
    """The target figures in one cell (the report's table of hosts)."""
    cell = f"tokens/s x{result.ratio:.2f}, first token +{result.ttft_over_ms:.2f} ms"
    return cell + (f" (lean loop x{result.lean_ratio:.2f})" if result.lean_ratio else "")


def _us(rate: float) -> float:
    return 1e6 / rate if rate > 0 else float("nan")


def section(result: GenerateResult) -> list[str]:
    loop = result.loop_tokens_s
    return [
        "## Generate: token streaming against a bare ONNX Runtime greedy loop",
        "",
        f"One stream of {result.tokens} tokens of the bundled GPT-2-like decoder "
        "(tests/fixtures/real/decoders/gpt2, also models/writer), one chunk a token, CPU "
        f"provider, {len(result.round_ratios) or 'several'} rounds: rates are the medians of "
        "the rounds, the ratio the median of each round's agent / bare (the two are measured "
        "one after the other); the agent runs as its own process (`edge-agent run`), its rate "
        "from the chunks' arrival at a C subscriber (`mosquitto_sub`); the bare loop runs a "
        "session with the agent's session options "
        "in the benchmark's process, alternating with the agent's requests.",
        "",
        "| | agent | bare loop | figure | target |",
        "|---|---|---|---|---|",
        f"| tokens/s | {result.agent_tokens_s:.0f} | {result.bare_tokens_s:.0f} | "
        f"x{result.ratio:.2f} | >= {TARGET_RATIO} |",
        f"| time to first token vs prefill (ms) | {result.agent_ttft_ms:.2f} | "
        f"{result.bare_prefill_ms:.2f} | +{result.ttft_over_ms:.2f} ms | <= {TARGET_TTFT_MS} ms |",
        f"| generate loop alone, no MQTT (tokens/s) | {loop:.0f} | "
        f"{result.bare_tokens_s:.0f} | x{loop / result.bare_tokens_s:.2f} | |",
        *_lean_lines(result),
        "",
        f"Per token: the model's run and a bare loop's numpy {_us(result.bare_tokens_s):.0f} "
        f"µs; the generate loop (token choice, cache and mask handling, text decoding) "
        f"{_us(loop) - _us(result.bare_tokens_s):+.0f} µs on top; the rest "
        f"{_us(result.agent_tokens_s) - _us(loop):+.0f} µs: making, spooling and publishing "
        "the chunk, and the model's run itself slowed by sharing the two cores with the "
        "broker, the subscriber and the agent's other threads.",
        "",
        *_concurrent_lines(result),
        *_cuda_lines(result.cuda),
    ]


def _lean_lines(result: GenerateResult) -> list[str]:
    """The lean row (a reference with no agent, decision 0040) and what it is."""
    if not result.lean_tokens_s:
        return []
    return [
        f"| lean loop, no agent (tokens/s) | {result.lean_tokens_s:.0f} | "
        f"{result.bare_tokens_s:.0f} | x{result.lean_ratio:.2f} | reference |",
        "",
        "The lean row is the generate loop above publishing each token's chunk itself at "
        "QoS 1, from its own thread on a minimal MQTT client, its writes timed as the agent's "
        "send hold times them, with no spool and no other thread (benchmarks/lean_loop.py, "
        "decision 0040): "
        "about the least a chunk a token costs a Python publisher on this machine.",
    ]


def _concurrent_lines(result: GenerateResult) -> list[str]:
    """Several requests at once, without and with `[batching]` (lock-step rows)."""
    if not result.batched_tokens_s:
        return []
    gain = result.batched_tokens_s / result.concurrent_tokens_s
    return [
        f"{CONCURRENT} requests at once ({result.tokens} tokens each, their chunks counted "
        "together by `mosquitto_sub`, alternating bursts): the model as it is, and the same "
        f"file with `[batching] max_batch = {CONCURRENT}`, whose requests step in lock-step, "
        "a row each (docs/decisions/0026):",
        "",
        "| | tokens/s of all | against each on its own |",
        "|---|---|---|",
        f"| {CONCURRENT} requests, each on its own | {result.concurrent_tokens_s:.0f} | |",
        f"| {CONCURRENT} requests, `[batching]` | {result.batched_tokens_s:.0f} | x{gain:.2f} |",
        "",
    ]


def _cuda_lines(cuda: GenerateResult | None) -> list[str]:
    """The same on ONNX Runtime's CUDA provider: the agent keeps the cache on the GPU
    (IOBinding), the bare loop feeds numpy arrays, as a plain loop does."""
    if cuda is None:
        return [
            "On the CUDA provider: not measured (this onnxruntime has no "
            "CUDAExecutionProvider; the section measures it where it has).",
            "",
        ]
    return [
        "On ONNX Runtime's CUDA provider (the agent keeps the cache on the GPU between steps; "
        "the bare loop feeds numpy arrays, as a plain loop does):",
        "",
        "| CUDA provider | agent | bare loop | figure | target |",
        "|---|---|---|---|---|",
        f"| tokens/s | {cuda.agent_tokens_s:.0f} | {cuda.bare_tokens_s:.0f} | "
        f"x{cuda.ratio:.2f} | >= {TARGET_RATIO} |",
        f"| time to first token vs prefill (ms) | {cuda.agent_ttft_ms:.2f} | "
        f"{cuda.bare_prefill_ms:.2f} | +{cuda.ttft_over_ms:.2f} ms | <= {TARGET_TTFT_MS} ms |",
        f"| generate loop alone, no MQTT (tokens/s) | {cuda.loop_tokens_s:.0f} | "
        f"{cuda.bare_tokens_s:.0f} | x{cuda.loop_tokens_s / cuda.bare_tokens_s:.2f} | |",
        "",
    ]


def main(argv: list[str] | None = None) -> int:
    return section_main(__doc__, "edge-bench-generate-", measure, section, met, argv)


if __name__ == "__main__":
    raise SystemExit(main())
