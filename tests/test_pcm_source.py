"""The pcm source: raw samples from a command, a FIFO or a file, through silero-vad's windows
with its state carried, compared with a plain onnxruntime loop over the same windows."""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.config import ConfigError, SourceConfig, load_config
from agent.demo import models as demo_models
from agent.demo.broker import EmbeddedBroker
from agent.models.backends.base import InferenceError, TensorSpec
from agent.models.model_config import parse_model_config
from agent.models.records import LoadedVersion
from agent.protocol.errors import Limits
from agent.service.agent import Agent
from agent.sources.base import SourceError
from agent.sources.pcm import CarriedState
from agent.sources.readers.pcm import RECORD_CHUNKS, PcmReader, PcmRecord, WindowPlan, to_float
from tests.conftest import agent_config
from tests.ops_helpers import wait_until
from tests.silero_helpers import HOP, LEAD, RATE, SILERO, WINDOW, scan_config
from tests.silero_helpers import reference as silero_reference
from tests.test_sources import (
    Subscriber,
    outputs,
    overtaken_by_requests,
    subscribe,
    write_config,
)

__all__ = ["subscribe"]  # the fixture, used by name

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def no_leaked_source_threads() -> Iterator[None]:
    yield
    deadline = time.monotonic() + 5
    while True:
        alive = [t.name for t in threading.enumerate() if t.name.startswith("source-")]
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not alive, f"source threads left running: {alive}"


def signal_s16() -> np.ndarray:
    """2.5 s at 16 kHz: quiet seeded noise with a 440 Hz tone burst in the middle, as s16."""
    rng = np.random.default_rng(26)
    n = int(2.5 * RATE)
    t = np.arange(n) / RATE
    x = 0.02 * rng.standard_normal(n)
    burst = (t > 0.8) & (t < 1.6)
    x[burst] += 0.5 * np.sin(2 * np.pi * 440 * t[burst])
    return np.clip(np.round(x * 32768), -32768, 32767).astype("<i2")


def reference(samples: np.ndarray) -> list[np.ndarray]:
    """silero's `output` per window of one recording, the last partial window dropped."""
    return list(silero_reference(samples.astype(np.float32)[None]))


@pytest.fixture(scope="module")
def vad_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pcm-models")
    (root / "vad" / "1").mkdir(parents=True)
    shutil.copy(SILERO, root / "vad" / "1" / "model.onnx")
    (root / "vad" / "config.toml").write_text(scan_config())
    (root / "mlp" / "1").mkdir(parents=True)
    demo_models.save(demo_models.mlp(), root / "mlp" / "1" / "model.onnx")
    return root


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    """The signal as an s16le file, and its samples as the agent sees them (/32768)."""
    s16 = signal_s16()
    path = tmp_path_factory.mktemp("pcm") / "signal.s16"
    path.write_bytes(s16.tobytes())
    return path, s16.astype(np.float32) / 32768


def pcm_source(name: str, where: str, **keys: Any) -> str:
    lines = [f'[[sources]]\nname = "{name}"\nkind = "pcm"\nmodel = "vad"\n{where}\n']
    lines += [f"{key} = {value}\n" for key, value in {"sample_rate": RATE, **keys}.items()]
    return "".join(lines)


def chunks_of(sub: Subscriber) -> list[dict[str, Any]]:
    seen: dict[int, dict[str, Any]] = {}
    for m in sub.bodies("chunk"):
        seen.setdefault(m["seq"], m)  # QoS 1: at least once
    return [seen[s] for s in sorted(seen)]


# --------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("keys", "problem"),
    [
        ("sample_rate = 16000\n", "exactly one of command, path"),
        ('command = ["arecord"]\npath = "x"\nsample_rate = 16000\n', "exactly one of"),
        ('command = ["arecord"]\n', "needs sample_rate"),
        ('command = ["arecord"]\nsample_rate = 16000\npolicy = "latest"\n', 'must be "all"'),
        ('command = ["arecord"]\nsample_rate = 16000\nformat = "u8"\n', "sources.0.format"),
        ("command = []\nsample_rate = 16000\n", "sources.0.command"),
    ],
)
def test_pcm_config_errors_name_the_key(tmp_path: Path, keys: str, problem: str) -> None:
    text = f'[[sources]]\nname = "mic"\nkind = "pcm"\nmodel = "vad"\n{keys}'
    with pytest.raises(ConfigError) as info:
        load_config(write_config(tmp_path, text), environ={})
    assert len(info.value.problems) == 1 and problem in info.value.problems[0]


def test_pcm_keys_belong_to_pcm_and_have_defaults(tmp_path: Path) -> None:
    text = '[[sources]]\nname = "p"\nkind = "pipe"\nmodel = "m"\npath = "-"\nsample_rate = 1\n'
    with pytest.raises(ConfigError, match='sample_rate: not for kind = "pipe"'):
        load_config(write_config(tmp_path, text), environ={})
    text = '[[sources]]\nname = "mic"\nkind = "pcm"\nmodel = "vad"\npath = "a.fifo"\n'
    config = load_config(write_config(tmp_path, text + "sample_rate = 16000\n"), environ={})
    (mic,) = config.sources
    assert (mic.format, mic.channels, mic.policy, mic.windows_per_chunk) == (
        "s16le",
        1,
        "all",
        None,
    )
    assert mic.path == tmp_path / "a.fifo"


def test_the_example_config_loads() -> None:
    config = load_config(REPO / "configs" / "vad-mic.toml", environ={})
    (mic,) = config.sources
    assert mic.kind == "pcm" and mic.command is not None and mic.command[0] == "arecord"


def test_to_float_scales_and_deinterleaves() -> None:
    s16 = np.array([0, -32768, 16384, 32767, -1, 2], dtype="<i2")
    stereo = to_float(s16.tobytes(), "s16le", 2)
    assert stereo.dtype == np.float32 and stereo.shape == (2, 3)
    np.testing.assert_array_equal(stereo[0], np.array([0, 0.5, -1 / 32768], np.float32))
    np.testing.assert_array_equal(stereo[1], np.array([-1, 32767 / 32768, 2 / 32768], np.float32))
    f32 = np.array([0.25, -0.5], dtype="<f4")
    np.testing.assert_array_equal(to_float(f32.tobytes(), "f32le", 1), f32[None])


class Counter:
    """A fake session: `output` = the window's sum + the state; `stateN` = state + 1; fails
    on a window whose first sample is negative."""

    inputs = (
        TensorSpec("input", np.dtype(np.float32), ("batch", 4)),
        TensorSpec("state", np.dtype(np.float32), ("batch", 1)),
        TensorSpec("sr", np.dtype(np.int64), ()),
    )
    outputs = (
        TensorSpec("output", np.dtype(np.float32), ("batch", 1)),
        TensorSpec("stateN", np.dtype(np.float32), ("batch", 1)),
    )
    providers = ("fake",)

    def run(self, inputs: Any) -> dict[str, np.ndarray]:
        window, state = inputs["input"], inputs["state"]
        assert int(inputs["sr"]) == RATE
        if window[0, 0] < 0:
            raise InferenceError("a negative window")
        return {"output": window.sum(axis=1, keepdims=True) + state, "stateN": state + 1}

    def close(self) -> None:
        pass


def test_a_failing_window_costs_its_chunk_and_the_state_goes_on_from_the_last_good_one() -> None:
    text = '[stream]\nmode = "scan"\nstate = { state = "stateN" }\n'
    text += f'[scan]\ninput = "input"\nwindow = 4\nhop = 2\n[defaults]\nsr = {RATE}\n'
    config = parse_model_config(text, "c.toml")
    loaded = LoadedVersion("vad", 1, Counter(), config, "fake")
    source = SourceConfig(name="s", kind="pcm", model="vad", path=Path("x"), sample_rate=RATE)
    carried = CarriedState(source)
    plan = WindowPlan("input", 4, 2, 0, "drop", 2, False)

    def record(*firsts: float, fresh: bool = False) -> PcmRecord:
        """A chunk of two windows for each of `firsts`, every sample of a chunk that value."""
        windows = np.repeat(np.array(firsts, np.float32), 2 * 4).reshape(-1, 1, 4)
        return PcmRecord({"input": windows}, plan=plan, fresh=fresh, count=len(firsts))

    def run(r: PcmRecord, chunk: int = 0) -> list[float]:
        return list(carried.run(loaded, r, chunk)["output"][:, 0, 0])

    assert run(record(1, fresh=True)) == [4, 5]  # stacked: two windows, state 0 then 1
    with pytest.raises(InferenceError):
        run(record(-1))
    assert run(record(1)) == [6, 7]
    assert run(record(1, fresh=True)) == [4, 5]
    several = record(1, -1, 2, fresh=True)  # one read made three chunks: one record
    assert run(several, 0) == [4, 5]
    with pytest.raises(InferenceError):
        run(several, 1)
    assert run(several, 2) == [10, 11]  # 8 + state 2, 3: the failed chunk moved nothing


class FileContext:
    """What a reader needs from its runner, for a pcm file."""

    def __init__(self, path: Path, per_chunk: int) -> None:
        self.config = SourceConfig(
            name="f",
            kind="pcm",
            model="vad",
            path=path,
            sample_rate=RATE,
            windows_per_chunk=per_chunk,
        )
        self.limits = Limits()
        self.stop_event = threading.Event()

    def idle(self) -> None:
        pass


@pytest.mark.parametrize("per_chunk", [1, 3])
def test_a_read_becomes_records_of_whole_chunks_with_their_offsets(
    recording: tuple[Path, np.ndarray], per_chunk: int
) -> None:
    """Each 64 kB read of a file gives its whole chunks, at most RECORD_CHUNKS a record; a
    chunk's windows and offset are those of cutting the whole signal at once."""
    path, samples = recording
    padded = np.concatenate([np.zeros(LEAD, np.float32), samples])
    total = (len(padded) - WINDOW) // HOP + 1
    plan = WindowPlan("input", WINDOW, HOP, LEAD, "drop", per_chunk, False)
    reader = PcmReader(FileContext(path, per_chunk), plan)
    try:
        records = list(reader.records())
    finally:
        reader.close()
    assert all(isinstance(r, PcmRecord) and 1 <= r.count <= RECORD_CHUNKS for r in records)
    assert max(r.count for r in records) == RECORD_CHUNKS  # a 64 kB read holds more
    chunks = [(r, c) for r in records for c in range(r.count)]
    assert len(chunks) == -(-total // per_chunk)
    for n, (r, c) in enumerate(chunks):
        assert isinstance(r, PcmRecord)
        first = n * per_chunk
        assert r.chunk_extra(c) == {"offset": first * HOP}
        want = [
            padded[k * HOP : k * HOP + WINDOW] for k in range(first, min(first + per_chunk, total))
        ]
        np.testing.assert_array_equal(r.windows(c)[:, 0], np.stack(want))
    assert [r.fresh for r in records] == [True] + [False] * (len(records) - 1)
    cut = records[0].first(2)
    assert cut.count == 2 and len(cut.fields["input"]) == 2 * per_chunk


# --------------------------------------------------------------------------- through an agent


@pytest.fixture
def start_pcm(
    broker: EmbeddedBroker,
    vad_repository: Path,
    tmp_path: Path,
    make_agent: Callable[..., Agent],
    subscribe: Callable[..., Subscriber],
) -> Callable[[str, str], tuple[Agent, Subscriber, Subscriber]]:
    """`start_pcm(toml, name)`: an agent with the source(s) of `toml` on `vad_repository`;
    it, its events and source `name`'s stream, both subscribed before it starts."""

    def start(toml: str, name: str) -> tuple[Agent, Subscriber, Subscriber]:
        config = agent_config(tmp_path, broker, vad_repository, toml)
        events = subscribe(broker, f"{config.root_topic}/events")
        sub = subscribe(broker, f"{config.root_topic}/stream/{name}")
        agent = make_agent(broker, vad_repository, toml=toml, DEVICE_ID=f'"{config.device_id}"')
        return agent, events, sub

    return start


def test_command_windows_match_a_plain_loop_and_state_resets_on_restart(
    recording: tuple[Path, np.ndarray],
    start_pcm: Callable[[str, str], tuple[Agent, Subscriber, Subscriber]],
) -> None:
    """The command writes the signal in pieces that cut sample frames, and an odd byte at the
    end; when it exits the source restarts it, and the windows start again from offset 0
    with the state from zeros."""
    path, samples = recording
    want = reference(samples)
    script = (
        f"import sys\nd = open({str(path)!r}, 'rb').read() + b'\\x01'\n"
        "for i in range(0, len(d), 1001):\n"
        "    sys.stdout.buffer.write(d[i : i + 1001]); sys.stdout.buffer.flush()\n"
    )
    command = f"command = [{sys.executable!r}, '-c', {script!r}]"
    toml = pcm_source("mic", command, retry_min_s=0.2, retry_max_s=0.3)
    _, events, sub = start_pcm(toml, "mic")
    assert sub.wait_for(lambda ms: len(ms) >= 2 * len(want), 30), len(sub.messages)
    chunks = chunks_of(sub)
    first, second = chunks[: len(want)], chunks[len(want) : 2 * len(want)]
    for run in (first, second):
        assert [m["offset"] for m in run] == [k * HOP for k in range(len(want))]
        for m, expected in zip(run, want, strict=True):
            got = outputs(m)
            assert set(got) == {"output"}  # the state output is carried, not sent
            np.testing.assert_allclose(got["output"], expected, rtol=1e-5, atol=1e-5)
    indexes = [m["index"] for m in chunks]
    assert indexes == list(range(indexes[0], indexes[0] + len(indexes)))
    assert all(m["id"] == "mic" and m["model"] == "vad" and "frame_ts" in m for m in chunks)
    failed = [m for m in events.bodies() if m["type"] == "source_failed"]
    assert failed and "exited with status 0" in failed[0]["error"], failed


def test_f32_file_in_chunks_of_windows_then_finished(
    recording: tuple[Path, np.ndarray],
    tmp_path: Path,
    start_pcm: Callable[[str, str], tuple[Agent, Subscriber, Subscriber]],
) -> None:
    """A float32 file, four windows a message (stacked on a new leading axis); the last
    message has what is left; the source finishes at the end of the file."""
    _, samples = recording
    want = reference(samples)
    f32 = tmp_path / "signal.f32"
    f32.write_bytes(samples.astype("<f4").tobytes())
    toml = pcm_source("file", f'path = "{f32}"', format='"f32le"', windows_per_chunk=4)
    agent, events, sub = start_pcm(toml, "file")
    assert events.wait_for(lambda ms: any(m["type"] == "source_finished" for m in ms), 30)
    count = -(-len(want) // 4)
    assert sub.wait_for(lambda ms: len(ms) >= count, 10)
    chunks = chunks_of(sub)
    assert [m["offset"] for m in chunks] == [4 * k * HOP for k in range(count)]
    got = np.concatenate([outputs(m)["output"] for m in chunks])
    assert outputs(chunks[0])["output"].shape == (4, 1, 1) and got.shape == (len(want), 1, 1)
    np.testing.assert_allclose(got, np.stack(want), rtol=1e-5, atol=1e-5)
    assert agent.sources.runner("file").snapshot()["state"] == "finished"


def test_a_sample_rate_the_model_does_not_take_refuses_the_source(
    broker: EmbeddedBroker,
    recording: tuple[Path, np.ndarray],
    make_client: Callable[..., Any],
    start_pcm: Callable[[str, str], tuple[Agent, Subscriber, Subscriber]],
) -> None:
    path, _ = recording
    toml = pcm_source("mic", f'path = "{path}"', sample_rate=8000, retry_min_s=5, retry_max_s=5)
    agent, events, sub = start_pcm(toml, "mic")
    assert events.wait_for(lambda ms: any(m["type"] == "source_failed" for m in ms), 10)
    failed = next(m for m in events.bodies() if m["type"] == "source_failed")
    assert "sample_rate = 8000 does not match model 'vad'" in failed["error"], failed
    assert "sr = 16000" in failed["error"]
    client = make_client(broker, agent)  # the agent goes on serving
    client.infer("mlp", {"x": np.zeros((1, 16), dtype=np.float32)}, timeout=10)
    assert agent.sources.runner("mic").snapshot()["state"] == "failed"
    assert not sub.bodies("chunk")


def test_max_frames_cuts_a_record_of_several_chunks(
    recording: tuple[Path, np.ndarray],
    start_pcm: Callable[[str, str], tuple[Agent, Subscriber, Subscriber]],
) -> None:
    """One read of the file makes records of RECORD_CHUNKS chunks; `max_frames` counts chunks
    (the stream's messages) and ends the source after exactly that many."""
    path, samples = recording
    want = reference(samples)[:7]
    toml = pcm_source("cut", f'path = "{path}"', max_frames=7)
    _, events, sub = start_pcm(toml, "cut")
    assert events.wait_for(lambda ms: any(m["type"] == "source_finished" for m in ms), 30)
    finished = next(m for m in events.bodies() if m["type"] == "source_finished")
    assert finished["frames"] == 7
    assert sub.wait_for(lambda ms: len(ms) >= 7, 10)
    time.sleep(0.3)  # nothing more comes
    chunks = chunks_of(sub)
    assert [m["index"] for m in chunks] == list(range(7))
    assert [m["offset"] for m in chunks] == [k * HOP for k in range(7)]
    for m, expected in zip(chunks, want, strict=True):
        np.testing.assert_allclose(outputs(m)["output"], expected, rtol=1e-5, atol=1e-5)


def test_requests_overtake_a_busy_pcm_source_between_the_chunks_of_a_record(
    broker: EmbeddedBroker,
    tmp_path: Path,
    make_agent: Callable[..., Agent],
    make_client: Callable[..., Any],
) -> None:
    """A read of a file makes records of many windows; with the one worker kept busy by them,
    a request still waits for one window's run at most, not for the rest of the record."""
    from tests.test_sources import matmul_chain, run_time_ms

    repository = tmp_path / "models"
    per_link = run_time_ms(matmul_chain(2)) / 2
    slow = matmul_chain(max(1, round(10.0 / max(per_link, 0.01))))  # ~10 ms a window
    (repository / "slowscan" / "1").mkdir(parents=True)
    demo_models.save(slow, repository / "slowscan" / "1" / "model.onnx")
    (repository / "slowscan" / "config.toml").write_text(
        '[stream]\nmode = "scan"\n[scan]\ninput = "x"\nwindow = 256\nhop = 256\n'
    )
    (repository / "mlp" / "1").mkdir(parents=True)
    demo_models.save(demo_models.mlp(), repository / "mlp" / "1" / "model.onnx")
    audio = tmp_path / "long.s16"
    audio.write_bytes(np.zeros(RATE * 8, dtype="<i2").tobytes())  # 500 windows
    source = pcm_source("busy", f'path = "{audio}"', priority=0, qos=0)
    agent = make_agent(
        broker,
        repository,
        toml=source.replace('model = "vad"', 'model = "slowscan"'),
        SCHEDULER__WORKERS="1",
        MODELS__INTRA_OP_THREADS="1",
    )
    client = make_client(broker, agent)
    x = {"x": np.zeros((1, 16), dtype=np.float32)}
    client.infer("mlp", x, timeout=10)
    runner = agent.sources.runner("busy")
    deadline = time.monotonic() + 10
    while runner.snapshot()["published"] < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    overtaken = overtaken_by_requests(client, runner, x)  # windows, one frame each
    snapshot = runner.snapshot()
    assert snapshot["max_pending"] >= 1 and runner.state == "running"
    # `queue` (8) bounds the frames read ahead, a record counting as its chunks: at most 7
    # waiting before a record of RECORD_CHUNKS goes in whole, one record in the model, and
    # one more read (counted in `frames` as it is read) waiting for room in the queue.
    ahead = snapshot["frames"] - snapshot["published"]
    assert ahead <= 7 + 3 * RECORD_CHUNKS, snapshot
    # Counted in windows, not milliseconds (as for frames in tests/test_sources.py): the one
    # in the model, and the next may finish before the reply reaches the client; a request
    # that waited for the rest of a record would see up to RECORD_CHUNKS.
    assert statistics.median(overtaken) <= 2, overtaken
    assert max(overtaken) <= 4 < RECORD_CHUNKS, overtaken


class CommandContext(FileContext):
    """A pcm source reading a command's standard output."""

    def __init__(self, command: list[str]) -> None:
        super().__init__(Path("unused"), 1)
        self.config = SourceConfig(
            name="c", kind="pcm", model="vad", command=command, sample_rate=RATE
        )


def test_closing_a_command_ends_what_it_started(tmp_path: Path) -> None:
    """Only the command itself was stopped: a wrapper script's quiet child outlived every
    restart of the source and the agent, holding what it held (a capture device)."""
    pid_file = tmp_path / "child.pid"
    script = f"exec 1>&-; sleep 3600 & echo $! > {pid_file}; wait"  # its output closed
    plan = WindowPlan("input", WINDOW, HOP, LEAD, "drop", 1, False)
    reader = PcmReader(CommandContext(["sh", "-c", script]), plan)
    try:
        with pytest.raises(SourceError):  # its output closed: the source would restart it
            list(reader.records())
        assert wait_until(lambda: pid_file.exists() and pid_file.read_text().strip(), 5)
        child = int(pid_file.read_text())
        os.kill(child, 0)  # alive
    finally:
        reader.close()
    assert wait_until(lambda: not _alive(child), 5)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for this purpose
        return f.read().split(") ")[-1][0] != "Z"
