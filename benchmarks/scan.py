"""Scan: windows a second of silero-vad through the agent against a bare ONNX Runtime loop over
the same windows.

The agent side is a pcm source reading an s16le file (`kind = "pcm"`, `path`): it cuts the
recording into the model's `[scan]` windows, runs one window at a time with the state carried
and publishes each window's result (QoS 1, through the spool) on `ROOT/stream/NAME`. That is
the agent's whole per-window path (windowing, the model run, the state hand-over, encoding,
the spool, publishing) with no requester in the loop, which a scan request would add. The rate
comes from the chunks' emit times (`ts`). "Bare" is `InferenceSession.run` over the same
windows with the state fed back, same threads, in this process, once before and once after
the agent's run; the figure is the agent's rate against their mean. A scan request's row
follows, and a reference row with no agent at all (`lean`, benchmarks/lean_loop.py): the bare
loop publishing each window's chunk itself.

    python benchmarks/scan.py [--quick]     # this section alone, printed
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from agent.demo.broker import EmbeddedBroker  # noqa: E402
from benchmarks.harness import section_main  # noqa: E402
from benchmarks.lean_loop import LeanPublisher, alternate  # noqa: E402
from benchmarks.sources import StreamRecorder, threads  # noqa: E402
from tests.silero_helpers import HOP, LEAD, RATE, SILERO, WINDOW, scan_config  # noqa: E402

TARGET = 0.9
MODEL = "vad"
PER_CHUNK = (1, 16)  # windows a message: the target row, then what batching messages buys


@dataclass
class ScanResult:
    windows_per_chunk: int
    windows: int  # in the recording
    bare_wps: float  # windows a second, mean of the bare runs before and after
    agent_wps: float
    ratio: float
    # "source": a pcm source; "request": one scan request; "lean": the reference loop with no
    # agent (benchmarks/lean_loop.py), its windows those of the request row
    path: str = "source"
    infer_us: float | None = None  # request: the model's run a window inside the agent
    # request: the same at QoS 0, and with `stream: false` (no chunk at all); 0: not measured
    infer_qos0_us: float = 0.0
    infer_whole_us: float = 0.0

    @property
    def overhead_us(self) -> float:
        return (1 / self.ratio - 1) / self.bare_wps * 1e6 if self.ratio else 0.0


def recording(seconds: float) -> np.ndarray:
    """Seeded noise with a tone burst every other second, as s16 samples."""
    rng = np.random.default_rng(26)
    n = int(seconds * RATE)
    t = np.arange(n) / RATE
    x = 0.02 * rng.standard_normal(n) + 0.4 * np.sin(2 * np.pi * 440 * t) * (t.astype(int) % 2)
    return np.clip(np.round(x * 32768), -32768, 32767).astype("<i2")


def windows_of(s16: np.ndarray) -> list[np.ndarray]:
    """The windows the agent runs: `lead` zeros first, the last partial window dropped."""
    padded = np.concatenate([np.zeros(LEAD, np.float32), s16.astype(np.float32) / 32768])
    count = (len(padded) - WINDOW) // HOP + 1
    return [np.ascontiguousarray(padded[None, k * HOP : k * HOP + WINDOW]) for k in range(count)]


def bare_session() -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads()
    return ort.InferenceSession(str(SILERO), options, providers=["CPUExecutionProvider"])


def window_loop(
    session: Any, windows: Sequence[np.ndarray], publisher: LeanPublisher | None = None
) -> float:
    """Windows a second of every window through ORT with the state fed back, as a plain loop
    would; given a `publisher`, each window's output published as a chunk (the lean row)."""
    state = np.zeros((2, 1, 128), np.float32)
    sr = np.array(RATE, dtype=np.int64)
    started = time.perf_counter()
    for n, window in enumerate(windows):
        output, state = session.run(None, {"input": window, "state": state, "sr": sr})
        if publisher is not None:
            publisher.chunk(n, {"output": output}, offset=n * HOP)
    if publisher is not None:
        publisher.end()
    return len(windows) / (time.perf_counter() - started)


def bare_wps(windows: list[np.ndarray]) -> float:
    """`window_loop` on a fresh session, after 200 windows to warm it."""
    session = bare_session()
    window_loop(session, windows[:200])
    return window_loop(session, windows)


def lean_vs_bare(
    broker: EmbeddedBroker, workdir: Path, windows: list[np.ndarray], rounds: int
) -> tuple[float, float, float]:
    """The lean row: `window_loop` bare and publishing, in turn, on one session."""
    session = bare_session()
    publisher = LeanPublisher(broker, workdir)
    try:
        return alternate(
            lambda: window_loop(session, windows),
            lambda: window_loop(session, windows, publisher),
            rounds,
        )
    finally:
        publisher.close()


def add_model(repository: Path) -> None:
    (repository / MODEL / "1").mkdir(parents=True, exist_ok=True)
    shutil.copy(SILERO, repository / MODEL / "1" / "model.onnx")
    (repository / MODEL / "config.toml").write_text(scan_config())


def run_agent(
    workdir: Path, broker: EmbeddedBroker, repository: Path, audio: Path, per_chunk: int
) -> subprocess.Popen[bytes]:
    name = f"scan{per_chunk}"
    config = workdir / f"agent-{name}.toml"
    config.write_text(
        f'device_id = "bench-scan"\nstate_dir = "{workdir / "state"}"\nlog_level = "warning"\n'
        f'[mqtt]\nhost = "{broker.host}"\nport = {broker.port}\n'
        f'[models]\nrepository = "{repository}"\nintra_op_threads = {threads()}\nwatch = "off"\n'
        "[scheduler]\nworkers = 2\n[telemetry]\ninterval_s = 0\n[metrics]\nenabled = false\n"
        f'[[sources]]\nname = "{name}"\nkind = "pcm"\nmodel = "{MODEL}"\npath = "{audio}"\n'
        f"sample_rate = {RATE}\nwindows_per_chunk = {per_chunk}\nqos = 1\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(  # cwd: `-m` puts it first on sys.path, before PYTHONPATH
        [sys.executable, "-m", "agent.cli", "run", "--config", str(config)], env=env, cwd=REPO
    )


def agent_wps(
    workdir: Path, broker: EmbeddedBroker, repository: Path, audio: Path, windows: int, k: int
) -> float:
    """Windows a second from the emit times of the messages, the first 5 % left out (the
    model's first runs, the subscriber's start)."""
    messages = -(-windows // k)
    recorder = StreamRecorder(broker, f"edge/bench-scan/stream/scan{k}")
    agent = run_agent(workdir, broker, repository, audio, k)
    try:
        deadline = time.monotonic() + 120
        while recorder.count() < messages:
            if time.monotonic() > deadline or agent.poll() is not None:
                raise RuntimeError(f"the agent sent {recorder.count()} of {messages} messages")
            time.sleep(0.1)
    finally:
        agent.terminate()
        agent.wait(60)
        recorder.close()
    frames = recorder.frames()
    skip = len(frames) // 20
    first, last = frames[skip], frames[-1]
    return (len(frames) - 1 - skip) * k * 1e9 / (last[1] - first[1])


def measure(broker: EmbeddedBroker, workdir: Path, quick: bool) -> list[ScanResult]:
    repository = workdir / "scan-models"
    add_model(repository)
    s16 = recording(60.0 if quick else 240.0)
    audio = workdir / "recording.s16"
    audio.write_bytes(s16.tobytes())
    windows = windows_of(s16)
    results = []
    for k in PER_CHUNK:
        before = bare_wps(windows)
        agent = agent_wps(workdir, broker, repository, audio, len(windows), k)
        bare = (before + bare_wps(windows)) / 2
        result = ScanResult(k, len(windows), bare, agent, agent / bare)
        print(
            f"scan, {k} window(s) a message: agent {agent:.0f} windows/s, bare {bare:.0f} "
            f"(x{result.ratio:.2f})",
            flush=True,
        )
        results.append(result)
    seconds = 8.0 if quick else 30.0  # float32, within one request's payload limit
    s16 = recording(seconds)
    windows = windows_of(s16)
    before = bare_wps(windows)
    agent, infer = request_wps(workdir, broker, repository, s16, len(windows), 3 if quick else 5)
    infer_us = infer["qos1"]
    bare = (before + bare_wps(windows)) / 2
    results.append(
        ScanResult(
            1,
            len(windows),
            bare,
            agent,
            agent / bare,
            "request",
            infer_us,
            infer_qos0_us=infer["qos0"],
            infer_whole_us=infer["whole"],
        )
    )
    print(
        f"scan request: agent {agent:.0f} windows/s, bare {bare:.0f} (x{agent / bare:.2f}); "
        f"the model's run in the agent {infer_us:.0f} µs a window (QoS 0 {infer['qos0']:.0f}, "
        f"stream false {infer['whole']:.0f}), bare {1e6 / bare:.0f}"
    )
    bare, lean, ratio = lean_vs_bare(broker, workdir, windows, 3 if quick else 8)
    results.append(ScanResult(1, len(windows), bare, lean, ratio, "lean"))
    print(f"lean loop, no agent: {lean:.0f} windows/s, bare {bare:.0f} (x{ratio:.2f})")
    return results


def request_wps(
    workdir: Path,
    broker: EmbeddedBroker,
    repository: Path,
    s16: np.ndarray,
    windows: int,
    rounds: int,
) -> tuple[float, dict[str, float]]:
    """Windows a second of the recording sent as one scan request (one window a chunk, QoS 1),
    the median of `rounds`, each from the chunks' arrival at `mosquitto_sub`, the first 5 %
    left out; and the median time of the model's run a window inside the agent (µs, from the
    `end`'s `timing.infer_ms`) for that request ("qos1"), the same at QoS 0 ("qos0") and with
    `stream: false` ("whole"), sent in turn in every round."""
    from benchmarks.harness import AgentProcess, one_request, unique_id, wait_online

    audio = (s16.astype(np.float32) / 32768)[None, :]
    rates: list[float] = []
    infer_us: dict[str, list[float]] = {"qos1": [], "qos0": [], "whole": []}
    variants: dict[str, dict[str, Any]] = {
        "qos1": {},
        "qos0": {"qos": 0},
        "whole": {"stream": False},
    }
    with AgentProcess(workdir / "request", broker, repository, device_id="bench-scan-r") as agent:
        wait_online(broker, agent.root, agent.started)
        for n in range(rounds + 1):  # the first warms
            for name, extra in variants.items():
                body = {"id": unique_id("scan"), "inputs": {"input": audio}, **extra}
                messages = 1 if name == "whole" else windows + 1
                subscriber = one_request(broker, agent.root, MODEL, body, messages)
                if not n:
                    continue
                infer_us[name].append(
                    subscriber.bodies()[-1]["timing"]["infer_ms"] * 1000 / windows
                )
                if name == "qos1":
                    arrived = subscriber.times()[:windows]
                    skip = len(arrived) // 20
                    rates.append((len(arrived) - 1 - skip) / (arrived[-1] - arrived[skip]))
    return statistics.median(rates), {k: statistics.median(v) for k, v in infer_us.items()}


def to_json(results: list[ScanResult]) -> dict[str, Any]:
    return {"results": [dataclasses.asdict(r) for r in results]}


def from_json(data: dict[str, Any]) -> list[ScanResult]:
    return [ScanResult(**item) for item in data["results"]]


def _target_rows(results: list[ScanResult]) -> list[ScanResult]:
    return [r for r in results if r.windows_per_chunk == 1 and r.path != "lean"]


def met(results: list[ScanResult]) -> bool:
    return all(r.ratio >= TARGET for r in _target_rows(results))


def headline(results: list[ScanResult]) -> str:
    """The target figures in one cell (the report's table of hosts), and the lean loop's."""
    cells = [f"{r.path} x{r.ratio:.2f}" for r in _target_rows(results)]
    lean = [f"lean loop x{r.ratio:.2f}" for r in results if r.path == "lean"]
    return ", ".join(cells) + (f" ({lean[0]})" if lean else "")


def section(results: list[ScanResult]) -> list[str]:
    lines = [
        "## Scan: windows with carried state",
        "",
        "silero-vad (576-sample windows, 512 new samples each, state carried) on a recording "
        f"of {results[0].windows if results else 0} windows. Through the agent: a pcm source "
        "reading the recording as an s16le file (its own process, 2 workers, "
        f"{threads()} intra-op thread(s), results at QoS 1 through the spool); the rate comes "
        "from the messages' emit times. Bare: `InferenceSession.run` over the same windows "
        "with the state fed back, same threads, before and after the agent's run (the mean). "
        "The source path is the agent's whole per-window path without a requester in the loop.",
        "",
        "A second row sends a recording of "
        f"{next((r.windows for r in results if r.path == 'request'), 0)} windows as one scan "
        "request (`inputs.input`, float32), one window a chunk at QoS 1, its rate from the "
        "chunks' arrival at `mosquitto_sub`, the median of the rounds; bare as above over "
        "those windows.",
        "",
        "The `lean` row is a reference, not the agent: the bare loop over the request row's "
        "windows that also makes each window's chunk with the protocol's own encoder and "
        "publishes it at QoS 1 from its own thread on a minimal MQTT client, its writes timed "
        "as the agent's send hold times them, with no spool and no other thread "
        "(benchmarks/lean_loop.py, decision 0040): about the least that one message a window "
        "costs a Python publisher on this machine.",
        "",
        "| path | windows a message | bare inference | through the agent (lean: the loop) | "
        "agent / bare | agent cost per window | target |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.path == "lean":
            verdict = "reference"
        elif r.windows_per_chunk == 1:
            verdict = f">= {TARGET} " + ("met" if r.ratio >= TARGET else "**missed**")
        else:
            verdict = "report"
        cost = f"{r.overhead_us:.0f} µs" if r.overhead_us >= 0 else "none measurable"
        lines.append(
            f"| {r.path} | {r.windows_per_chunk} | {r.bare_wps:.0f} windows/s | {r.agent_wps:.0f} "
            f"windows/s | **{r.ratio:.2f}** | {cost} | {verdict} |"
        )
    window_us = 1e6 / results[0].bare_wps if results else 0.0
    lines += [
        "",
        f"A silero window runs in about {window_us:.0f} µs here, and every stream message adds "
        "a fixed cost of its own (encoding, the spool, the publish): at one window a message "
        "that cost bounds the rate, and several windows a message (`windows_per_chunk`) share "
        "it.",
        *_model_share(results),
        "",
    ]
    return lines


def _model_share(results: list[ScanResult]) -> list[str]:
    """How much of the request row's cost per window is the model running slower in the
    agent than in the bare loop (the `end`'s `timing.infer_ms`), and when it does."""
    request = next((r for r in results if r.path == "request" and r.infer_us), None)
    if request is None or request.infer_us is None or request.overhead_us <= 0:
        return []
    bare_us = 1e6 / request.bare_wps
    slower = request.infer_us - bare_us
    lines = [
        "",
        f"Of the request row's {request.overhead_us:.0f} µs a window, the model's own run "
        f"accounts for {slower:.0f}: inside the agent it took {request.infer_us:.0f} µs a "
        f"window (the `end`'s `timing.infer_ms`), {bare_us:.0f} µs in the bare loop.",
    ]
    if request.infer_qos0_us and request.infer_whole_us:
        lines[-1] += (
            f" The same request run in turn at QoS 0 took {request.infer_qos0_us:.0f} µs a "
            f"window, and with `stream: false` (no chunk at all) {request.infer_whole_us:.0f}: "
            "the model sharing the two cores with the rest of the path (the broker, the "
            "subscriber, the agent's other threads) runs slower than alone, more so the more "
            "messages and acknowledgements go with it."
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    return section_main(__doc__, "edge-bench-scan-", measure, section, met, argv)


if __name__ == "__main__":
    raise SystemExit(main())
