"""Local sources: frames per second through the agent against bare inference of the same model.

A synthetic source (`policy = "latest"`, faster than the model) feeds a conv net through an
agent running as its own process, with results at QoS 1 (spooled) on `ROOT/stream/NAME`; a
bare paho subscriber counts them. "Bare" is `InferenceSession.run` in a loop on the same
model, same intra-op threads, same input, in this process while the agent is paused
(SIGSTOP); agent windows and bare loops alternate and the medians are compared, so drift and
noisy neighbours hit both alike. When the model is the bottleneck the agent should deliver
>= 0.9 of the bare rate: what it spends per frame (scheduling, encoding, the spool,
publishing) must stay small against inference.

    python benchmarks/sources.py [--quick]     # this section alone, printed
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import paho.mqtt.client as mqtt

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from agent import demo_models, wire  # noqa: E402
from agent.broker import EmbeddedBroker  # noqa: E402
from agent.preprocess import PreprocessConfig, preprocess  # noqa: E402
from agent.repository import parse_model_config  # noqa: E402

TARGET = 0.9
BIG = 640  # conv_net input side (as a detector's): ~10 ms a frame on one core, the bottleneck
CAMERA = (720, 1280, 3)  # the frames of the preprocessing row
PREPROCESS = f"""\
[preprocess]
input = "image"
resize = [{BIG}, {BIG}]
scale = "1/255"
mean = [0.485, 0.456, 0.406]
std = [0.229, 0.224, 0.225]
"""


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    size: int
    frame_shape: tuple[int, ...] | None  # synthetic camera frames (preprocessed) or None
    bottleneck: bool  # the >= 0.9 target applies

    def describe(self) -> str:
        what = f"conv_net 3x{self.size}x{self.size}"
        if self.frame_shape is not None:
            h, w, _ = self.frame_shape
            return f"{what}, {w}x{h} uint8 frames through [preprocess]"
        return f"{what}, model-shaped tensors"


CASES = (
    Case("net", "src-net", BIG, None, True),
    Case("net-pre", "src-net-pre", BIG, CAMERA, False),
    Case("tiny", "src-tiny", 32, None, False),
)


@dataclass
class SourceResult:
    case: Case
    bare_fps: float
    bare_pre_fps: float | None  # preprocess + inference, bare (the preprocessing row)
    agent_fps: float
    read: int  # frames the source made in the window
    published: int

    @property
    def ratio(self) -> float:
        return self.agent_fps / self.bare_fps

    @property
    def dropped(self) -> int:
        return self.read - self.published

    @property
    def overhead_us(self) -> float:
        """What one frame costs the agent beyond the model (per frame, serial)."""
        return (1 / self.agent_fps - 1 / self.bare_fps) * 1e6


def to_json(result: SourceResult) -> dict[str, Any]:
    return dataclasses.asdict(result)


def from_json(data: dict[str, Any]) -> SourceResult:
    case = dict(data["case"])
    shape = case["frame_shape"]
    case["frame_shape"] = tuple(shape) if shape is not None else None
    return SourceResult(**{**data, "case": Case(**case)})


def add_models(repository: Path) -> None:
    for case in CASES:
        folder = repository / case.model
        (folder / "1").mkdir(parents=True, exist_ok=True)
        demo_models.save(demo_models.conv_net(size=case.size), folder / "1" / "model.onnx")
        if case.frame_shape is not None:
            (folder / "config.toml").write_text(PREPROCESS)


def threads() -> int:
    """The intra-op threads the agent gives each session with 2 workers."""
    return max(1, (os.cpu_count() or 1) // 2)


class Bare:
    """`InferenceSession.run` in a loop: the same model, threads and input as the agent's."""

    def __init__(self, path: Path, size: int, pre: PreprocessConfig | None = None) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads()
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.x = np.zeros((1, 3, size, size), dtype=np.float32)
        self.frame = np.zeros(CAMERA, dtype=np.uint8)
        self.pre = pre

    def fps(self, seconds: float) -> float:
        warm_until = time.perf_counter() + 0.1  # caches, page faults, the clock ramping up
        while time.perf_counter() < warm_until:
            self.session.run(None, {"image": self.x})
        runs = 0
        started = time.perf_counter()
        while time.perf_counter() - started < seconds:
            feed = self.x if self.pre is None else preprocess(self.frame, self.pre, bgr=True)
            self.session.run(None, {"image": feed})
            runs += 1
        return runs / (time.perf_counter() - started)


class StreamCounter:
    """Counts chunk messages of one stream and remembers the frame numbers (`index`)."""

    def __init__(self, broker: EmbeddedBroker, topic: str) -> None:
        self.indexes: list[int] = []
        self._lock = threading.Lock()
        self._subscribed = threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
        self.client.on_connect = lambda c, u, f, rc, p: c.subscribe(topic, 1)
        self.client.on_subscribe = lambda c, u, mid, codes, p: self._subscribed.set()
        self.client.on_message = self._on_message
        self.client.connect(broker.host, broker.port)
        self.client.loop_start()
        if not self._subscribed.wait(10):
            raise RuntimeError("no SUBACK")

    def _on_message(self, client: mqtt.Client, userdata: object, message: mqtt.MQTTMessage) -> None:
        body = wire.decode_payload(message.payload, wire.Limits())
        if body.get("type") == "chunk":
            with self._lock:
                self.indexes.append(int(body["index"]))

    def mark(self) -> int:
        with self._lock:
            return len(self.indexes)

    def since(self, mark: int) -> list[int]:
        with self._lock:
            return self.indexes[mark:]

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def run_agent(
    workdir: Path, broker: EmbeddedBroker, repository: Path, case: Case, rate_hz: float
) -> subprocess.Popen[bytes]:
    config = workdir / f"agent-{case.name}.toml"
    source = (
        f'[[sources]]\nname = "{case.name}"\nkind = "synthetic"\nmodel = "{case.model}"\n'
        f"rate_hz = {rate_hz:.1f}\nqos = 1\n"
    )
    if case.frame_shape is not None:
        source += f"frame_shape = {list(case.frame_shape)}\n"
    config.write_text(
        f'device_id = "bench-src"\nstate_dir = "{workdir / "state"}"\nlog_level = "warning"\n'
        f'[mqtt]\nhost = "{broker.host}"\nport = {broker.port}\n'
        f'[models]\nrepository = "{repository}"\nintra_op_threads = {threads()}\nwatch = "off"\n'
        "[scheduler]\nworkers = 2\n[telemetry]\ninterval_s = 0\n[metrics]\nenabled = false\n"
        + source
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "run", "--config", str(config)], env=env
    )


def measure_case(
    workdir: Path, broker: EmbeddedBroker, repository: Path, case: Case, quick: bool
) -> SourceResult:
    """Agent windows and bare loops taken in turns, the agent paused (SIGSTOP) during each
    bare loop: both see the same machine, and drift or a noisy neighbour hits both alike.
    The ratio is of the medians."""
    model_file = repository / case.model / "1" / "model.onnx"
    # Many short turns rather than a few long ones: this VM's speed moves by 15 % from one
    # second to the next (bare loops of 1 s read 78-117 fps in one minute), and the medians of
    # more, interleaved samples follow the same moves on both sides.
    rounds, window, bare_s = (2, 0.8, 0.3) if quick else (9, 1.5, 1.0)
    bare = Bare(model_file, case.size)
    pre = None
    if case.frame_shape is not None:
        config = parse_model_config(PREPROCESS, "config.toml").preprocess
        pre = Bare(model_file, case.size, config)
    first = bare.fps(bare_s)
    counter = StreamCounter(broker, f"edge/bench-src/stream/{case.name}")
    agent = run_agent(workdir, broker, repository, case, rate_hz=min(5000.0, 1.5 * first))
    agent_rates: list[float] = []
    bare_rates = [first]
    pre_rates: list[float] = []
    read = published = 0
    try:
        deadline = time.monotonic() + 60
        while counter.mark() < 20:  # started, loaded, warm
            if time.monotonic() > deadline or agent.poll() is not None:
                raise RuntimeError(f"the agent produced no results for {case.name}")
            time.sleep(0.05)
        for _ in range(rounds):
            time.sleep(0.2)  # settled after the start or the pause
            mark = counter.mark()
            started = time.monotonic()
            time.sleep(window)
            got = counter.since(mark)
            agent_rates.append(len(got) / (time.monotonic() - started))
            if got:
                read += got[-1] - got[0] + 1
                published += len(got)
            os.kill(agent.pid, signal.SIGSTOP)
            try:
                time.sleep(0.05)  # what was in flight arrives
                bare_rates.append(bare.fps(bare_s))
                if pre is not None:
                    pre_rates.append(pre.fps(bare_s))
            finally:
                os.kill(agent.pid, signal.SIGCONT)
    finally:
        agent.terminate()
        agent.wait(60)
        counter.close()
    return SourceResult(
        case,
        statistics.median(bare_rates),
        statistics.median(pre_rates) if pre_rates else None,
        statistics.median(agent_rates),
        read,
        published,
    )


def measure(broker: EmbeddedBroker, workdir: Path, quick: bool) -> list[SourceResult]:
    repository = workdir / "source-models"
    add_models(repository)
    results = []
    for case in CASES:
        result = measure_case(workdir, broker, repository, case, quick)
        print(
            f"source {case.name}: agent {result.agent_fps:.0f} fps, bare {result.bare_fps:.0f} fps"
            f" (x{result.ratio:.2f}), dropped {result.dropped} of {result.read}",
            flush=True,
        )
        results.append(result)
    return results


def met(results: list[SourceResult]) -> bool:
    return all(r.ratio >= TARGET for r in results if r.case.bottleneck)


def section(results: list[SourceResult]) -> list[str]:
    lines = [
        "## Local sources",
        "",
        'A synthetic source (`policy = "latest"`, at 1.5x the model\'s bare rate, so a frame is '
        "always waiting) feeds a conv net through the agent (its own process, 2 workers, "
        f"{threads()} intra-op thread(s) a session, results at QoS 1 through the spool on "
        "`ROOT/stream/NAME`); a bare paho subscriber counts the results. Bare = "
        "`InferenceSession.run` in a loop on the same model, threads and input, in the "
        "benchmark process while the agent is paused (SIGSTOP); agent windows and bare loops "
        "alternate and the table compares their medians. One frame of a source runs at a "
        "time, so the agent can at best match the bare rate; what it spends per frame beyond "
        "the model (scheduling, preprocessing, encoding, the spool, publishing, and the "
        "slowdown that work causes on the other core of this 2-core machine) shows as the gap.",
        "",
        "| source | bare inference | through the agent | agent / bare | frames dropped "
        "(latest) | agent cost per frame | target |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.case.bottleneck:
            verdict = f">= {TARGET} " + ("met" if r.ratio >= TARGET else "**missed**")
        elif r.case.frame_shape is not None:
            assert r.bare_pre_fps is not None
            like = r.agent_fps / r.bare_pre_fps
            verdict = (
                f"report; bare with the same preprocessing: {r.bare_pre_fps:.0f} fps (x{like:.2f})"
            )
        else:
            verdict = "reference: overhead-bound"
        share = r.dropped / r.read if r.read else 0.0
        lines.append(
            f"| {r.case.describe()} | {r.bare_fps:.0f} fps | {r.agent_fps:.0f} fps | "
            f"**{r.ratio:.2f}** | {r.dropped} of {r.read} ({share:.0%}) | "
            f"{r.overhead_us:.0f} µs | {verdict} |"
        )
    lines += [
        "",
        "Reading it: the first row is the target (the model is the bottleneck). The second adds "
        "the model's `[preprocess]` (resize from camera size, normalise, NCHW) on the worker, "
        "which bare inference does not pay; against a bare loop that preprocesses the same way "
        "(last column) it is the like-for-like figure. The tiny model's row shows the agent's "
        "fixed cost per frame, which bounds the rate of small models.",
        "",
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="edge-bench-src-") as tmp, EmbeddedBroker() as broker:
        results = measure(broker, Path(tmp), args.quick)
    print("\n".join(section(results)))
    print(f"({time.monotonic() - started:.1f} s)")
    return 0 if met(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
