"""One stream alone: the agent's chunks/s against a lone raw paho publisher of the same payload.

One `steps` stream of a tiny decoder (hidden size 8) is the agent's per-chunk cost on one
serial path: each step waits for the one before it. Both publishers are counted by the same C
subscriber (`mosquitto_sub`, benchmarks/harness.py), agent and raw runs alternate within one
run (the order flips every round) and each QoS is measured `rounds` times, so a drift in this
shared machine's speed falls on both; the figure is the median of the rounds' ratios.

Per-thread CPU: the agent runs with a bench-only `sitecustomize` that gives each Python thread
its name in the kernel (`prctl(PR_SET_NAME)`; Python 3.11 does not), so `/proc/PID/task/*/stat`
tells the worker, `mqtt-io` and `spool-writer` apart; their CPU over a stream, divided by its
chunks, is each thread's cost per chunk.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from agent.demo import models as demo_models
from agent.demo.broker import EmbeddedBroker
from agent.demo.run import DECODER_CONFIG
from benchmarks import speed
from benchmarks.harness import REPO, AgentProcess, stat_cpu_s, wait_online

MODEL = "decoder-tiny"
DIMS = (32, 8, 8)  # vocab, embed, hidden: chunks of about a hundred bytes
TARGETS = {"1": 0.8, "0": 0.9}  # agent / raw, one stream alone
TTFC_REPEATS = 20
TTFC_STEPS = 8

# Names each thread in the kernel as Python names it (15 bytes at most), for /proc: the agent
# does it itself since agent/threads.py; this keeps older trees (benchmarks/history.py) named.
THREAD_NAMES = """\
import ctypes
import threading

_prctl = ctypes.CDLL(None).prctl
_bootstrap = threading.Thread._bootstrap_inner


def _named(self):
    _prctl(15, self.name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    _bootstrap(self)


threading.Thread._bootstrap_inner = _named
"""


@dataclass
class Round:
    qos: int
    raw: float  # messages/s
    agent: float  # chunks/s
    chunks: int
    cpu_us: dict[str, float]  # per chunk, by thread name
    switches: dict[str, float] = field(default_factory=dict)  # context switches per chunk
    model: float = 0.0  # steps/s of the model alone (`model_alone`), measured after the round

    @property
    def ratio(self) -> float:
        return self.agent / self.raw if self.raw else 0.0


@dataclass
class OneStreamResult:
    quick: bool
    payload_bytes: int = 0
    rounds: list[Round] = field(default_factory=list)
    first_chunk_ms: float = 0.0  # median, publish to arrival, TTFC_STEPS-step streams

    def of(self, qos: int) -> list[Round]:
        return [r for r in self.rounds if r.qos == qos]

    def ratio(self, qos: int) -> float | None:
        rounds = self.of(qos)
        return statistics.median(r.ratio for r in rounds) if rounds else None

    def cpu_us(self, qos: int) -> dict[str, float]:
        """Median per-chunk CPU of each thread over the rounds (threads seen in any)."""
        rounds = self.of(qos)
        names = sorted({name for r in rounds for name in r.cpu_us})
        return {n: statistics.median(r.cpu_us.get(n, 0.0) for r in rounds) for n in names}

    def model_alone(self) -> float | None:
        """Median steps/s of the model alone over all rounds."""
        rates = [r.model for r in self.rounds if r.model]
        return statistics.median(rates) if rates else None

    def switches(self, qos: int) -> dict[str, float]:
        """Median context switches per chunk of each thread (its sleeps and preemptions:
        each a hand-off of the GIL or of the CPU)."""
        rounds = self.of(qos)
        names = sorted({name for r in rounds for name in r.switches})
        return {n: statistics.median(r.switches.get(n, 0.0) for r in rounds) for n in names}


def met(result: OneStreamResult) -> bool:
    return all((result.ratio(int(q)) or 0.0) >= t for q, t in TARGETS.items())


def headline(result: OneStreamResult) -> str:
    """The target figures in one cell (the report's table of hosts)."""
    return ", ".join(f"QoS {q}: x{r:.2f}" for q in (1, 0) if (r := result.ratio(q)) is not None)


def to_json(result: OneStreamResult) -> dict[str, Any]:
    return asdict(result)


def from_json(data: dict[str, Any]) -> OneStreamResult:
    rounds = [Round(**r) for r in data.get("rounds", [])]
    return OneStreamResult(**{**data, "rounds": rounds})


# -- measuring --------------------------------------------------------------------------------


def thread_cpu(pid: int) -> tuple[dict[str, float], dict[str, float]]:
    """CPU seconds and context switches so far of each thread of `pid`, summed by the
    thread's kernel name."""
    cpu: dict[str, float] = {}
    switches: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            text = (task / "stat").read_text()
            status = (task / "status").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        name = text[text.index("(") + 1 : text.rindex(")")]
        family = _family(name)
        cpu[family] = cpu.get(family, 0.0) + stat_cpu_s(text)
        counted = [int(line.split()[1]) for line in status.splitlines() if "ctxt_switches" in line]
        switches[family] = switches.get(family, 0.0) + sum(counted)
    return cpu, switches


def _family(name: str) -> str:
    """`worker-0` and `worker-1` are one row: whichever runs the stream."""
    head, _, tail = name.rpartition("-")
    return head if head and tail.isdigit() else name


def _add_model(repository: Path) -> None:
    (repository / MODEL / "1").mkdir(parents=True)
    vocab, embed, hidden = DIMS
    model = demo_models.gru_decoder(vocab=vocab, embed=embed, hidden=hidden)
    demo_models.save(model, repository / MODEL / "1" / "model.onnx")
    (repository / MODEL / "config.toml").write_text(
        DECODER_CONFIG.format(steps=speed.MEMORY_CHUNKS)
    )


def _agent_round(agent: AgentProcess, broker: EmbeddedBroker, qos: int, steps: int) -> Round:
    cpu_before, switches_before = thread_cpu(agent.pid)
    rate = speed.measure_agent_stream(broker, agent.root, qos, steps, 1, MODEL)
    cpu_after, switches_after = thread_cpu(agent.pid)
    chunks = steps + 1
    cpu = {n: (s - cpu_before.get(n, 0.0)) / chunks * 1e6 for n, s in cpu_after.items()}
    switches = {n: (k - switches_before.get(n, 0)) / chunks for n, k in switches_after.items()}
    return Round(
        qos,
        0.0,
        rate,
        chunks,
        {n: round(us, 2) for n, us in cpu.items() if us > 0},
        {n: round(k, 3) for n, k in switches.items() if k > 0},
    )


def model_alone(path: Path, seconds: float) -> float:
    """Steps/s of the decoder step alone, run as the agent runs it (its ONNX Runtime backend
    and threads, the steps bound once, `next_token` copied out: docs/decisions/0032), each
    step's `next_token` and `h_out` fed back, no chunk made, in this process."""
    from agent.models.backends.base import BackendOptions, bind_steps
    from agent.models.backends.onnxruntime import OnnxRuntimeBackend

    session = OnnxRuntimeBackend().load(path, BackendOptions(speed._threads()))
    links = {"token": "next_token", "h": "h_out"}
    inputs = {"token": np.array([[1]], dtype=np.int64), "h": np.zeros((1, DIMS[2]), np.float32)}
    outputs = session.run(inputs)
    fed = {"token": outputs["next_token"], "h": outputs["h_out"]}
    binding = bind_steps(session, fed, outputs, links)
    assert binding is not None
    steps = 0
    started = time.perf_counter()
    try:
        while time.perf_counter() - started < seconds:
            for _ in range(200):
                binding.run(("next_token",))
            steps += 200
        return steps / (time.perf_counter() - started)
    finally:
        binding.close()
        session.close()


def first_chunk_ms(agent: AgentProcess, broker: EmbeddedBroker, repeats: int) -> float:
    from agent.client import AgentClient

    token = {"token": np.array([[1]], dtype=np.int64)}
    firsts = []
    with AgentClient(broker.host, broker.port, device_id=agent.device_id) as client:
        for i in range(repeats + 3):
            reply = client.request(MODEL, token, params={"max_steps": TTFC_STEPS}, timeout=30)
            arrivals = [chunk.received - reply.sent_at for chunk in reply]
            if i >= 3:  # warm-up first
                firsts.append(arrivals[0])
    return statistics.median(firsts) * 1000


def measure(broker: EmbeddedBroker, workdir: Path, quick: bool) -> OneStreamResult:
    result = OneStreamResult(quick=quick)
    seconds, rounds = (1.5, 3) if quick else (4.0, 5)
    repository = workdir / "one-stream-models"
    _add_model(repository)
    hooks = workdir / "thread-names"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(THREAD_NAMES)
    env = {"PYTHONPATH": f"{hooks}{os.pathsep}{REPO}"}
    token = {"token": np.array([[1]], dtype=np.int64)}
    with AgentProcess(workdir, broker, repository, env=env) as agent:
        wait_online(broker, agent.root, agent.started)
        if not speed.wait_model(broker, agent.root, MODEL, token, params={"max_steps": 1}):
            raise RuntimeError(f"{MODEL} did not load")
        payload = speed.chunk_payload(broker, agent.root, MODEL)
        result.payload_bytes = len(payload)
        result.first_chunk_ms = first_chunk_ms(agent, broker, TTFC_REPEATS)
        print(f"one stream: first chunk {result.first_chunk_ms:.2f} ms", flush=True)
        steps = {}
        for qos in (1, 0):  # sized by a probe to last about `seconds`
            probe = speed.measure_agent_stream(broker, agent.root, qos, 2000, 1, MODEL)
            steps[qos] = int(min(max(2000, probe * seconds), speed.MEMORY_CHUNKS))
        for i in range(rounds):
            for qos in (1, 0):
                raw_first = (i + qos) % 2 == 0
                raw = speed.measure_raw(broker, workdir, payload, qos, seconds) if raw_first else 0
                one = _agent_round(agent, broker, qos, steps[qos])
                one.raw = raw or speed.measure_raw(broker, workdir, payload, qos, seconds)
                one.model = model_alone(repository / MODEL / "1" / "model.onnx", seconds / 4)
                result.rounds.append(one)
                print(
                    f"one stream QoS {qos}: agent {one.agent:.0f}/s, raw {one.raw:.0f}/s, "
                    f"x{one.ratio:.2f}, CPU us/chunk {one.cpu_us}, switches {one.switches}",
                    flush=True,
                )
                time.sleep(0.2)
    return result


# -- report -----------------------------------------------------------------------------------


def section(result: OneStreamResult) -> list[str]:
    lines = [
        "## One stream alone",
        "",
        f"One QoS 1 (and QoS 0) `steps` stream of a tiny GRU decoder (vocab, embed, hidden "
        f"{DIMS}; {result.payload_bytes}-byte chunks) against a lone raw paho publisher of the "
        "same payload at the same QoS, both counted by the same `mosquitto_sub` in the same "
        f"run, alternating, {len(result.of(1))} rounds each; the ratio is the median of the "
        "rounds'. Each step waits for the one before it, so this is the agent's per-chunk "
        "cost on one serial path (docs/decisions/0029).",
        "",
        "| figure | agent (median) | raw paho (median) | ratio | rounds | target |",
        "|---|---|---|---|---|---|",
    ]
    for qos in (1, 0):
        rounds = result.of(qos)
        ratio = result.ratio(qos)
        if not rounds or ratio is None:
            continue
        target = TARGETS[str(qos)]
        verdict = "met" if ratio >= target else "**missed**"
        lines.append(
            f"| chunks/s, QoS {qos}, one stream: agent / raw paho | "
            f"{statistics.median(r.agent for r in rounds):.0f} chunks/s | "
            f"{statistics.median(r.raw for r in rounds):.0f} msg/s | **{ratio:.2f}** | "
            + ", ".join(f"{r.ratio:.2f}" for r in rounds)
            + f" | >= {target:g} {verdict} |"
        )
    model = result.model_alone()
    if model:
        raws = {q: statistics.median(r.raw for r in result.of(q)) for q in (1, 0) if result.of(q)}
        ceilings = "; ".join(f"QoS {q}: {model / raw:.2f}" for q, raw in raws.items())
        lines.append(
            "| steps/s of the model alone (run as the agent runs it, bound once, outputs fed "
            "back, no chunk) / raw "
            f"paho: the ceiling of the ratios above | {model:.0f} steps/s | | {ceilings} | "
            + ", ".join(f"{r.model:.0f}" for r in result.of(1))
            + " | report |"
        )
    lines += [
        f"| time to first chunk, {TTFC_STEPS}-step stream, median of {TTFC_REPEATS} | "
        f"{result.first_chunk_ms:.2f} ms | | | | report |",
        "",
        "The agent runs the model once a chunk, so its rate cannot pass the model's own: "
        "where one run of the step costs more than a raw paho publish, no design "
        "that runs the model once a chunk reaches the ratio of 1.",
        "",
        "Per chunk and agent thread, median of the rounds: CPU (µs; `/proc/PID/task/*/stat`, "
        "10 ms ticks) and context switches (`/proc/PID/task/*/status`: each a sleep or a "
        "preemption, a hand-off of the GIL or of the CPU):",
        "",
        "| QoS | figure | " + " | ".join(_threads(result)) + " | all |",
        "|---|---|" + "---|" * (len(_threads(result)) + 1),
    ]
    for qos in (1, 0):
        for label, values, digits in (
            ("CPU µs", result.cpu_us(qos), 1),
            ("switches", result.switches(qos), 2),
        ):
            if values:
                cells = [f"{values.get(name, 0.0):.{digits}f}" for name in _threads(result)]
                total = f"{sum(values.values()):.{digits}f}"
                lines.append(f"| {qos} | {label} | " + " | ".join(cells) + f" | {total} |")
    lines.append("")
    return lines


def _threads(result: OneStreamResult) -> list[str]:
    """The threads worth a column: those with 0.5 µs a chunk or more at either QoS."""
    names = {n for q in (0, 1) for n, us in result.cpu_us(q).items() if us >= 0.5}
    return sorted(names)
