"""Local sources: synthetic, folder, video and pipe sources streaming on ROOT/stream/NAME."""

from __future__ import annotations

import itertools
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import cbor2
import numpy as np
import onnx
import paho.mqtt.client as mqtt
import pytest
from onnx import TensorProto, helper, numpy_helper

from agent.config import ConfigError, load_config, masked_dict, to_toml
from agent.demo import models as demo_models
from agent.demo.broker import EmbeddedBroker
from agent.models.model_config import ModelConfigError, parse_model_config
from agent.models.preprocess import PreprocessConfig, PreprocessError, preprocess
from agent.ops import logs
from agent.protocol.errors import Limits
from agent.protocol.payload import decode_payload
from agent.protocol.tensors import decode_tensor, encode_tensor
from agent.service.agent import Agent
from agent.sources import FramingError, SeqStore, SourceError, cbor_item_end
from tests.conftest import agent_config, unique_device

REPO = Path(__file__).resolve().parent.parent
LIMITS = Limits()

try:
    import cv2
except ImportError:  # pragma: no cover - the test extra installs it
    cv2 = None

needs_cv2 = pytest.mark.skipif(cv2 is None, reason="OpenCV (opencv-python-headless) not installed")


@pytest.fixture(autouse=True)
def no_leaked_source_threads() -> Iterator[None]:
    """Every `source-NAME` thread is joined when its agent stops."""
    yield
    deadline = time.monotonic() + 5
    while True:
        alive = [t.name for t in threading.enumerate() if t.name.startswith("source-")]
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not alive, f"source threads left running: {alive}"


# --------------------------------------------------------------------------- helpers


def matmul_chain(links: int, size: int = 256) -> onnx.ModelProto:
    """A model whose cost is `links` dense size x size matmuls: input x [1, size] -> y [1, 1]."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(np.array([size, size], dtype=np.int64), "shape")]
    nodes = [helper.make_node("Expand", ["x", "shape"], ["h0"])]
    for i in range(links):
        w = (rng.standard_normal((size, size)) / np.sqrt(size)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        nodes.append(helper.make_node("MatMul", [f"h{i}", f"w{i}"], [f"h{i + 1}"]))
    nodes.append(helper.make_node("ReduceMean", [f"h{links}"], ["y"], axes=[0, 1], keepdims=1))
    graph = helper.make_graph(
        nodes,
        "matmul_chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", demo_models.OPSET)])
    model.ir_version = demo_models.IR_VERSION
    return model


def run_time_ms(model: onnx.ModelProto, repeats: int = 20) -> float:
    """Median time of one run with one intra-op thread (what each of 2 workers gets on 2 cores)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(
        demo_models.to_bytes(model), options, providers=["CPUExecutionProvider"]
    )
    feed = {"x": np.zeros((1, 256), dtype=np.float32)}
    for _ in range(3):
        session.run(None, feed)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        session.run(None, feed)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


@pytest.fixture(scope="module")
def slow_repository(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    """`slow` (~10 ms a run on this CPU, sized by measuring), `mlp` (batch) and `net`
    (conv_net with a [preprocess] section); returns the folder and slow's measured run time."""
    root = tmp_path_factory.mktemp("source-models")
    per_link = run_time_ms(matmul_chain(2)) / 2
    links = max(1, round(10.0 / max(per_link, 0.01)))
    slow = matmul_chain(links)
    measured = run_time_ms(slow)
    (root / "slow" / "1").mkdir(parents=True)
    demo_models.save(slow, root / "slow" / "1" / "model.onnx")
    (root / "mlp" / "1").mkdir(parents=True)
    demo_models.save(demo_models.mlp(), root / "mlp" / "1" / "model.onnx")
    (root / "net" / "1").mkdir(parents=True)
    demo_models.save(demo_models.conv_net(), root / "net" / "1" / "model.onnx")
    (root / "net" / "config.toml").write_text(NET_CONFIG)
    return root, measured


NET_CONFIG = """\
[preprocess]
input = "image"
resize = [32, 32]
scale = "1/255"
mean = [0.5, 0.5, 0.5]
std = [0.25, 0.25, 0.25]
layout = "NCHW"
"""


class Subscriber:
    """A bare paho subscriber that keeps every decoded message with its arrival time."""

    def __init__(self, broker: EmbeddedBroker, pattern: str, qos: int = 1) -> None:
        self.messages: list[tuple[int, str, dict[str, Any]]] = []
        self._cond = threading.Condition()
        self._subscribed = threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
        self.client.on_connect = lambda c, u, f, rc, p: c.subscribe(pattern, qos)
        self.client.on_subscribe = lambda c, u, mid, codes, p: self._subscribed.set()
        self.client.on_message = self._on_message
        self.client.connect(broker.host, broker.port)
        self.client.loop_start()
        assert self._subscribed.wait(10), "no SUBACK"

    def _on_message(self, client: mqtt.Client, userdata: object, message: Any) -> None:
        received = time.time_ns()
        decoded = decode_payload(message.payload, LIMITS)
        with self._cond:
            self.messages.append((received, message.topic, decoded))
            self._cond.notify_all()

    def wait_for(self, predicate: Callable[[list[dict[str, Any]]], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate([m for _, _, m in self.messages]):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def bodies(self, type_: str | None = None) -> list[dict[str, Any]]:
        with self._cond:
            return [m for _, _, m in self.messages if type_ is None or m.get("type") == type_]

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@pytest.fixture
def subscribe() -> Iterator[Callable[..., Subscriber]]:
    made: list[Subscriber] = []

    def make(broker: EmbeddedBroker, pattern: str, qos: int = 1) -> Subscriber:
        sub = Subscriber(broker, pattern, qos)
        made.append(sub)
        return sub

    yield make
    for sub in made:
        sub.close()


def outputs(message: dict[str, Any]) -> dict[str, np.ndarray]:
    return {k: decode_tensor(v, LIMITS, name=k) for k, v in message["outputs"].items()}


def unique_seqs(messages: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """QoS 1 delivers at least once: keep the first message of each seq."""
    seen: dict[int, dict[str, Any]] = {}
    for m in messages:
        seen.setdefault(m["seq"], m)
    return seen


# --------------------------------------------------------------------------- configuration


def overtaken_by_requests(
    client: Any, runner: Any, x: dict[str, np.ndarray], requests: int = 20
) -> list[int]:
    """For each of `requests` requests to `mlp` in turn: the frames the source finished
    while the request was on its way (published between sending it and its reply)."""
    overtaken = []
    for _ in range(requests):
        waited_from = runner.snapshot()["published"]
        client.infer("mlp", x, timeout=10)
        overtaken.append(runner.snapshot()["published"] - waited_from)
        time.sleep(0.005)
    return overtaken


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "agent.toml"
    path.write_text(text)
    return path


SYNTHETIC = '[[sources]]\nname = "s"\nkind = "synthetic"\nmodel = "m"\nrate_hz = 10\n'


def test_sources_config_defaults_and_paths(tmp_path: Path) -> None:
    config = load_config(
        write_config(
            tmp_path,
            SYNTHETIC + '[[sources]]\nname = "cam"\nkind = "video"\nmodel = "m"\npath = "in.avi"\n'
            '[[sources]]\nname = "rtsp"\nkind = "video"\nmodel = "m"\nurl = "rtsp://cam/1"\n'
            '[[sources]]\nname = "f"\nkind = "folder"\nmodel = "m"\npath = "drop"\n'
            '[[sources]]\nname = "p"\nkind = "pipe"\nmodel = "m"\npath = "-"\n',
        ),
        environ={},
    )
    s, cam, rtsp, folder, pipe = config.sources
    assert (s.policy, cam.policy, rtsp.policy, folder.policy, pipe.policy) == (
        "latest",
        "all",
        "latest",
        "all",
        "all",
    )
    assert cam.path == tmp_path / "in.avi" and folder.path == tmp_path / "drop"
    assert str(pipe.path) == "-"  # standard input, not a file next to the config
    assert s.priority == 2 and s.qos is None and s.seq_reserve == 1000


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (SYNTHETIC + "colour = 1\n", "unknown key 'sources.0.colour'"),
        ('[[sources]]\nname = "s"\nkind = "synthetic"\nmodel = "m"\n', "needs rate_hz"),
        (
            '[[sources]]\nname = "f"\nkind = "folder"\nmodel = "m"\npath = "d"\n'
            'policy = "latest"\n',
            'policy must be "all"',
        ),
        (SYNTHETIC + "loop = true\n", 'loop: not for kind = "synthetic"'),
        ('[[sources]]\nname = "v"\nkind = "video"\nmodel = "m"\n', "exactly one of path, url"),
        (SYNTHETIC + SYNTHETIC, "source name(s) used twice: s"),
        (SYNTHETIC.replace('"s"', '"a/b"'), "sources.0.name: must be 1-64"),
        (SYNTHETIC.replace('"s"', '".."'), "sources.0.name: must be 1-64"),
        (SYNTHETIC + "priority = 12\n", "sources.0.priority"),
        (SYNTHETIC.replace('"synthetic"', '"camera"'), "sources.0.kind"),
    ],
)
def test_sources_config_errors_name_the_key(tmp_path: Path, text: str, problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write_config(tmp_path, text), environ={})
    assert len(info.value.problems) == 1
    line = info.value.problems[0]
    assert problem in line and "\n" not in line and str(tmp_path) in line
    assert "Value error" not in line


def test_check_config_renders_sources_as_an_array_of_tables(tmp_path: Path) -> None:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib

    text = SYNTHETIC + 'inputs = { x = "frame" }\n[[sources]]\nname = "f"\nkind = "folder"\n'
    text += 'model = "m"\npath = "drop"\n'
    config = load_config(write_config(tmp_path, text), environ={})
    printed = to_toml(masked_dict(config))
    again = tomllib.loads(printed)
    assert [s["name"] for s in again["sources"]] == ["s", "f"]
    assert again["sources"][0]["inputs"] == {"x": "frame"}
    assert again["sources"][1]["path"] == str(tmp_path / "drop")
    assert "settle_s" not in again["sources"][0] and again["sources"][1]["settle_s"] == 0.5
    assert again["sources"][0]["fill"] == "zeros" and "fill" not in again["sources"][1]
    # What check-config prints is a valid configuration with the same sources.
    (tmp_path / "printed.toml").write_text(printed)
    assert load_config(tmp_path / "printed.toml", environ={}).sources == config.sources


# --------------------------------------------------------------------------- preprocessing


def test_preprocess_matches_a_plain_numpy_reference() -> None:
    config = PreprocessConfig.model_validate(
        {"scale": "1/255", "mean": [0.5, 0.4, 0.3], "std": [0.2, 0.25, 0.5], "layout": "NCHW"}
    )
    assert config.scale == pytest.approx(1 / 255)
    bgr = np.random.default_rng(1).integers(0, 256, (6, 8, 3), dtype=np.uint8)
    out = preprocess(bgr, config, bgr=True)
    rgb = bgr[:, :, ::-1].astype(np.float64)
    want = ((rgb / 255 - [0.5, 0.4, 0.3]) / [0.2, 0.25, 0.5]).transpose(2, 0, 1)[None]
    assert out.shape == (1, 3, 6, 8) and out.dtype == np.float32 and out.flags.c_contiguous
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_preprocess_without_work_is_a_view() -> None:
    config = PreprocessConfig.model_validate({"layout": "HWC", "dtype": "uint8", "color": "bgr"})
    frame = np.zeros((4, 4, 3), dtype=np.uint8)
    out = preprocess(frame, config, bgr=True)
    assert np.shares_memory(out, frame)


def test_preprocess_gray_and_nearest_resize_without_opencv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cv2", None)  # import cv2 now fails
    frame = np.arange(4 * 6 * 3, dtype=np.uint8).reshape(4, 6, 3)
    nearest = PreprocessConfig.model_validate(
        {"resize": [2, 3], "interpolation": "nearest", "color": "gray", "layout": "CHW"}
    )
    out = preprocess(frame, nearest)
    rgb = frame[::2, ::2].astype(np.float32)
    want = np.rint(rgb @ np.array([0.299, 0.587, 0.114], dtype=np.float32))[None]
    np.testing.assert_allclose(out, want, atol=1e-4)
    linear = PreprocessConfig.model_validate({"resize": [2, 3]})
    with pytest.raises(PreprocessError, match="needs OpenCV"):
        preprocess(frame, linear)


@needs_cv2
def test_preprocess_resizes_with_opencv() -> None:
    config = PreprocessConfig.model_validate({"resize": [16, 24], "layout": "NHWC"})
    frame = np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    out = preprocess(frame, config, bgr=True)
    want = cv2.cvtColor(cv2.resize(frame, (24, 16)), cv2.COLOR_BGR2RGB).astype(np.float32)
    np.testing.assert_array_equal(out[0], want)


def test_a_gray_frame_for_a_color_model_is_its_gray_on_every_channel() -> None:
    """H x W and H x W x 1 frames (documented as taken) were refused with the preprocessed
    shape's channel count: the gray goes on each of the model's three channels."""
    config = PreprocessConfig.model_validate({"scale": "1/255", "layout": "NCHW"})
    gray = np.random.default_rng(3).integers(0, 256, (6, 8), dtype=np.uint8)
    want = preprocess(np.repeat(gray[:, :, None], 3, axis=2), config)
    np.testing.assert_array_equal(preprocess(gray, config), want)
    np.testing.assert_array_equal(preprocess(gray[:, :, None], config), want)


@needs_cv2
def test_a_strip_is_resized_to_a_pixel_at_least_or_refused_when_too_long() -> None:
    """A 1 x 10000 strip letterboxed to 64 x 64 rounds to a height of 0, which OpenCV
    refuses with an assertion: it is a pixel high instead. Resized by its shortest edge to
    224, it would take 224 x 2,240,000 pixels: refused, saying so."""
    strip = np.full((1, 10000, 3), 200, dtype=np.uint8)
    letterbox = PreprocessConfig.model_validate(
        {"resize": [64, 64], "resize_mode": "letterbox", "layout": "NCHW"}
    )
    assert preprocess(strip, letterbox).shape == (1, 3, 64, 64)
    crop = PreprocessConfig.model_validate(
        {"resize": [224, 224], "resize_mode": "crop", "shortest_edge": 224, "layout": "NCHW"}
    )
    with pytest.raises(PreprocessError, match=r"1 x 10000 would be resized to 224 x 2240000"):
        preprocess(strip, crop)


def test_preprocess_section_is_checked_in_the_model_config() -> None:
    with pytest.raises(ModelConfigError, match=r"preprocess\.resize"):
        parse_model_config("[preprocess]\nresize = [32]\n", "config.toml")
    with pytest.raises(ModelConfigError, match=r"preprocess\.colour: unknown key"):
        parse_model_config('[preprocess]\ncolour = "rgb"\n', "config.toml")
    with pytest.raises(ModelConfigError, match="fraction"):
        parse_model_config('[preprocess]\nscale = "1/x"\n', "config.toml")
    config = parse_model_config(NET_CONFIG, "config.toml")
    assert config.preprocess is not None and config.preprocess.resize == [32, 32]


# --------------------------------------------------------------------------- seq store, framing


def test_seq_store_reserves_ahead_and_saves_the_exact_next_on_close(tmp_path: Path) -> None:
    path = tmp_path / "sources" / "cam.seq"
    store = SeqStore(path, reserve=100)
    assert store.start == 0
    store.ensure(1)  # seq 0 is about to be used
    assert path.read_text() == "101\n"
    store.ensure(101)  # still covered: no write
    assert path.read_text() == "101\n"
    store.ensure(102)
    assert path.read_text() == "202\n"
    crashed = SeqStore(path, reserve=100)  # no close(): a crash after seq 101
    assert crashed.start == 202  # above every seq used, never one of them again
    crashed.ensure(203)
    crashed.close(203)
    assert SeqStore(path, reserve=100).start == 203  # a clean stop: no gap
    with pytest.raises(Exception):  # noqa: B017 - after close nothing is numbered
        crashed.ensure(204)
    path.write_text("garbage\n")
    with pytest.raises(SourceError, match="delete it"):
        SeqStore(path, reserve=100)


def test_cbor_item_end_finds_records_in_a_sequence() -> None:
    records = [
        cbor2.dumps({"x": encode_tensor(np.arange(6, dtype=np.float32).reshape(2, 3))}),
        cbor2.dumps({"a": [1, 2, {"b": b"\x00" * 300}], "c": "text"}),
        b"\xbf\x61k\x9f\x01\x02\xff\xff",  # indefinite map holding an indefinite array
    ]
    stream = b"".join(records)
    ends, pos = [], 0
    while pos < len(stream):
        end = cbor_item_end(stream, pos, max_items=1000, max_depth=8)
        assert end is not None
        ends.append(end)
        pos = end
    assert ends == list(np.cumsum([len(r) for r in records]))
    for cut in range(1, len(records[0])):  # every prefix is incomplete, none an error
        assert cbor_item_end(records[0][:cut], 0, max_items=1000, max_depth=8) is None
    with pytest.raises(FramingError, match="nesting"):
        cbor_item_end(b"\x81" * 20 + b"\x01", 0, max_items=1000, max_depth=8)
    with pytest.raises(FramingError, match="items"):
        cbor_item_end(cbor2.dumps(list(range(100))), 0, max_items=50, max_depth=8)
    with pytest.raises(FramingError, match="break"):
        cbor_item_end(b"\xff", 0, max_items=50, max_depth=8)


# --------------------------------------------------------------------------- synthetic


def test_synthetic_source_drops_frames_under_latest_with_bounded_queue_and_latency(
    broker: EmbeddedBroker,
    slow_repository: tuple[Path, float],
    make_agent: Callable[..., Agent],
    subscribe: Callable[..., Subscriber],
) -> None:
    """200 Hz into a ~10 ms model: about half the frames are dropped, counted; one frame
    waits at most; the latency from capture to the subscriber stays flat."""
    repository, run_ms = slow_repository
    assert 5 <= run_ms <= 25, f"the slow model takes {run_ms:.1f} ms, not ~10 ms"
    agent = make_agent(
        broker,
        repository,
        toml='[[sources]]\nname = "fast"\nkind = "synthetic"\nmodel = "slow"\nrate_hz = 200\n'
        "qos = 0\n",
    )
    sub = subscribe(broker, f"{agent.root}/stream/fast", qos=0)
    runner = agent.sources.runner("fast")
    samples = []
    started = time.monotonic()
    while time.monotonic() - started < 3.0:
        samples.append((runner.pending, agent.scheduler.depth, len(agent.outbox)))
        time.sleep(0.01)
    snap = runner.snapshot()
    chunks = sub.bodies("chunk")
    assert snap["frames"] >= 450, snap  # ~600 at 200 Hz in 3 s
    # The model keeps up with ~100 Hz, so about half are dropped; how many depends on this
    # VM's speed during the test (23 % in one run where run_ms was measured at 10 ms), so the
    # bound only says that dropping clearly happened. The accounting below is exact.
    assert snap["dropped"] >= 0.1 * snap["frames"], snap
    assert snap["published"] + snap["dropped"] + snap["pending"] + 1 >= snap["frames"]
    # this VM's speed moves by up to 2x within seconds: a quarter of the measured pace
    assert snap["published"] >= 0.25 * 3000 / run_ms, snap
    assert max(p for p, _, _ in samples) <= 1 and snap["max_pending"] == 1
    assert max(d for _, d, _ in samples) <= 1  # one ticket per source in the scheduler
    assert max(o for _, _, o in samples) <= 16
    # The stream: seq contiguous, index increasing with gaps where frames were dropped.
    assert len(chunks) >= 100
    seqs = [m["seq"] for m in chunks]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    indexes = [m["index"] for m in chunks]
    assert all(b > a for a, b in itertools.pairwise(indexes))
    assert {m["id"] for m in chunks} == {"fast"} and chunks[0]["model"] == "slow"
    assert chunks[0]["version"] == 1 and chunks[0]["v"] == 1
    latency_ms = [
        (received - m["frame_ts"]) / 1e6 for received, _, m in sub.messages if "frame_ts" in m
    ]
    third = len(latency_ms) // 3
    early = statistics.median(latency_ms[:third])
    late = statistics.median(latency_ms[-third:])
    assert statistics.median(latency_ms) < 4 * run_ms + 20, latency_ms
    assert late < early + 2 * run_ms + 10, (early, late)  # not growing
    assert max(latency_ms[third:]) < 250


def test_requests_overtake_a_busy_source(
    broker: EmbeddedBroker,
    slow_repository: tuple[Path, float],
    make_agent: Callable[..., Agent],
    make_client: Callable[..., Any],
) -> None:
    """With one worker kept busy by a source, a request waits for one frame at most."""
    repository, _ = slow_repository
    agent = make_agent(
        broker,
        repository,
        toml='[[sources]]\nname = "busy"\nkind = "synthetic"\nmodel = "slow"\nrate_hz = 500\n'
        'priority = 0\nqos = 0\npolicy = "all"\nqueue = 8\n',  # 8 frames always waiting
        SCHEDULER__WORKERS="1",
        MODELS__INTRA_OP_THREADS="1",  # a core left for the network threads (2-core CI)
    )
    client = make_client(broker, agent)
    x = {"x": np.zeros((1, 16), dtype=np.float32)}
    client.infer("mlp", x, timeout=10)
    runner = agent.sources.runner("busy")
    time.sleep(0.3)
    before = runner.snapshot()["published"]
    overtaken = overtaken_by_requests(client, runner, x)
    busy = runner.snapshot()["published"] - before
    assert busy >= 10, busy  # the source kept the only worker busy meanwhile
    # A request waits for the frame being run at most, never for the 8 frames queued behind
    # it: counted in frames, not milliseconds. The frame after the request may finish before
    # the reply reaches the client, and on a loaded machine the one after that.
    assert statistics.median(overtaken) <= 2, overtaken
    assert max(overtaken) <= 4, overtaken


def test_synthetic_frames_go_through_the_models_preprocessing(
    broker: EmbeddedBroker,
    slow_repository: tuple[Path, float],
    make_agent: Callable[..., Agent],
    subscribe: Callable[..., Subscriber],
) -> None:
    """uint8 camera-sized frames, resized and normalised by `net`'s [preprocess] on the
    worker; `max_frames` ends the source with `source_finished`."""
    repository, _ = slow_repository
    toml = (
        '[[sources]]\nname = "cam"\nkind = "synthetic"\nmodel = "net"\nrate_hz = 100\n'
        'fill = "random"\nframe_shape = [120, 160, 3]\nmax_frames = 20\npolicy = "all"\n'
    )
    device = unique_device()
    events = subscribe(broker, f"edge/{device}/events")
    sub = subscribe(broker, f"edge/{device}/stream/cam")
    agent = make_agent(broker, repository, toml=toml, DEVICE_ID=f'"{device}"')
    assert events.wait_for(lambda ms: any(m["type"] == "source_finished" for m in ms), 10)
    assert sub.wait_for(lambda ms: len(ms) >= 20, 10)
    chunks = sub.bodies("chunk")
    assert [m["index"] for m in chunks] == list(range(20))
    assert all(outputs(m)["scores"].shape == (1, 10) for m in chunks)
    finished = next(m for m in events.bodies() if m["type"] == "source_finished")
    assert finished == {**finished, "source": "cam", "frames": 20}
    assert agent.sources.runner("cam").snapshot()["state"] == "finished"


def test_source_results_are_spooled_through_a_broker_outage(
    own_broker: EmbeddedBroker,
    slow_repository: tuple[Path, float],
    tmp_path: Path,
    make_agent: Callable[..., Agent],
) -> None:
    """QoS 1 results wait in the spool while the broker is down, then drain."""
    repository, _ = slow_repository
    folder = tmp_path / "inbox"
    folder.mkdir()
    agent = make_agent(
        own_broker,
        repository,
        toml=FOLDER_SOURCE.format(path=folder) + "qos = 1\n",
        MQTT__RECONNECT_MAX_S="0.5",
    )
    own_broker.stop()
    deadline = time.monotonic() + 10
    while agent.transport.connected.is_set() and time.monotonic() < deadline:
        time.sleep(0.05)
    names = drop_files(folder, 10)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and len(list((folder / "done").iterdir())) < 10:
        time.sleep(0.05)
    assert sorted(p.name for p in (folder / "done").iterdir()) == names  # queued offline
    assert agent.outbox.spooled >= 10  # on disk, not lost, not in an unbounded queue
    own_broker.start()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and agent.outbox.spooled:
        agent.outbox.flush_acks()
        time.sleep(0.1)
    assert agent.outbox.spooled == 0  # published and acknowledged after the outage


# --------------------------------------------------------------------------- folder


def drop_files(folder: Path, count: int, start: int = 0) -> list[str]:
    """.npy inputs for `slow`, written elsewhere and renamed in (complete at once)."""
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for i in range(start, start + count):
        name = f"item-{i:03d}.npy"
        tmp = folder / f".{name}.tmp"
        with open(tmp, "wb") as f:
            np.save(f, np.full((1, 256), i / 100, dtype=np.float32))
        os.replace(tmp, folder / name)
        names.append(name)
    return names


FOLDER_SOURCE = """\
[[sources]]
name = "inbox"
kind = "folder"
model = "slow"
path = "{path}"
settle_s = 0
poll_interval_s = 0.05
queue = 2
"""


def test_folder_processes_each_file_once_across_a_restart(
    broker: EmbeddedBroker,
    slow_repository: tuple[Path, float],
    tmp_path: Path,
    subscribe: Callable[..., Subscriber],
) -> None:
    repository, _ = slow_repository
    folder = tmp_path / "inbox"
    names = drop_files(folder, 40)
    toml = FOLDER_SOURCE.format(path=folder)
    config = agent_config(tmp_path, broker, repository, toml)
    sub = subscribe(broker, f"{config.root_topic}/stream/inbox")
    agent = Agent(config)
    agent.start()
    try:
        assert sub.wait_for(lambda ms: len(ms) >= 5, 20)
    finally:
        agent.stop()  # mid-way: files still waiting stay in the folder
    first_run = unique_seqs(sub.bodies("chunk"))
    done_then = sorted(p.name for p in (folder / "done").iterdir())
    assert 5 <= len(done_then) < 40
    assert sorted(m["file"] for m in first_run.values()) == done_then
    names += drop_files(folder, 5, start=40)  # more arrive while it is down

    again = Agent(config)  # the same device, state_dir and folder
    again.start()
    try:
        assert sub.wait_for(lambda ms: len(unique_seqs(ms)) >= 45, 30), len(sub.messages)
    finally:
        again.stop()
    results = unique_seqs(sub.bodies("chunk"))
    files = [m["file"] for m in results.values()]
    assert sorted(files) == sorted(names)  # every file, each exactly once
    assert sorted(p.name for p in (folder / "done").iterdir()) == sorted(names)
    assert not [p for p in folder.iterdir() if p.is_file()]
    seqs = sorted(results)
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # a clean stop leaves no gap
    second = [s for s, m in results.items() if m["file"] not in done_then]
    assert min(second) == max(first_run) + 1
    import onnxruntime as ort

    session = ort.InferenceSession(
        str(repository / "slow" / "1" / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    for m in list(results.values())[::9]:  # each result is its own file's
        x = np.load(folder / "done" / m["file"])
        np.testing.assert_allclose(outputs(m)["y"], session.run(None, {"x": x})[0], rtol=1e-4)
    assert again.sources.runner("inbox").snapshot()["errors"] == 0


def test_folder_moves_bad_files_to_failed(
    broker: EmbeddedBroker,
    slow_repository: tuple[Path, float],
    tmp_path: Path,
    make_agent: Callable[..., Agent],
    subscribe: Callable[..., Subscriber],
) -> None:
    repository, _ = slow_repository
    folder = tmp_path / "inbox"
    folder.mkdir()
    (folder / "broken.npy").write_bytes(b"not an npy file")
    np.save(folder / "wrong-shape.npy", np.zeros((2, 3), dtype=np.float32))
    np.save(folder / "pickled.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    (folder / "notes.txt").write_text("left alone")
    drop_files(folder, 1)
    agent = make_agent(broker, repository, toml=FOLDER_SOURCE.format(path=folder))
    sub = subscribe(broker, f"{agent.root}/stream/inbox")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len(list((folder / "failed").iterdir())) < 3:
        time.sleep(0.05)
    assert sorted(p.name for p in (folder / "failed").iterdir()) == [
        "broken.npy",
        "pickled.npy",
        "wrong-shape.npy",
    ]
    assert (folder / "notes.txt").exists()
    assert sub.wait_for(lambda ms: len(ms) >= 1, 10) or (folder / "done" / "item-000.npy").exists()
    snap = agent.sources.runner("inbox").snapshot()
    assert snap["bad_inputs"] == 3 and snap["state"] == "running"


def test_folder_files_that_cannot_be_moved_aside_run_once(
    broker: EmbeddedBroker,
    slow_repository: tuple[Path, float],
    tmp_path: Path,
    make_agent: Callable[..., Agent],
    subscribe: Callable[..., Subscriber],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A `done/` that could not be written (a full or read-only disk) made the source run the
    same file again at every scan, and count a bad file again at every scan, forever."""
    from agent.sources.readers import folder as folder_module

    repository, _ = slow_repository
    folder = tmp_path / "inbox"
    folder.mkdir()
    (folder / "broken.npy").write_bytes(b"not an npy file")
    drop_files(folder, 1)
    real_replace = os.replace
    disk = {"read_only": True}

    def replace(source: Any, target: Any) -> None:
        if disk["read_only"] and Path(target).parent.name in ("done", "failed"):
            raise OSError(30, "Read-only file system")
        real_replace(source, target)

    monkeypatch.setattr(folder_module.os, "replace", replace)
    agent = make_agent(broker, repository, toml=FOLDER_SOURCE.format(path=folder))
    sub = subscribe(broker, f"{agent.root}/stream/inbox")
    events = subscribe(broker, f"{agent.root}/events")
    assert sub.wait_for(lambda ms: len(ms) >= 1, 10)
    time.sleep(1.5)  # 30 scans
    assert len(unique_seqs(sub.bodies("chunk"))) == 1
    assert agent.sources.runner("inbox").snapshot()["bad_inputs"] == 1
    assert events.wait_for(lambda ms: any(m.get("type") == "source_failed" for m in ms), 10), [
        m.get("type") for m in events.bodies()
    ]
    disk["read_only"] = False  # moved at the next scan, still run once
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (folder / "done" / "item-000.npy").exists():
        time.sleep(0.1)
    assert (folder / "done" / "item-000.npy").exists() and (
        folder / "failed" / "broken.npy"
    ).exists()
    assert len(unique_seqs(sub.bodies("chunk"))) == 1


def test_a_file_whose_name_is_not_utf8_is_run_and_shown(
    broker: EmbeddedBroker,
    slow_repository: tuple[Path, float],
    tmp_path: Path,
    make_agent: Callable[..., Agent],
    subscribe: Callable[..., Subscriber],
) -> None:
    """Its result could not be encoded: the file went to `failed/` and its seq was never
    sent (a gap a subscriber reads as a lost message)."""
    repository, _ = slow_repository
    folder = tmp_path / "inbox"
    drop_files(folder, 1)
    latin = os.fsdecode(b"caf\xe9.npy")
    os.replace(folder / "item-000.npy", folder / latin)
    drop_files(folder, 1, start=1)
    agent = make_agent(broker, repository, toml=FOLDER_SOURCE.format(path=folder))
    sub = subscribe(broker, f"{agent.root}/stream/inbox")
    assert sub.wait_for(lambda ms: len(unique_seqs(ms)) >= 2, 10)
    results = unique_seqs(sub.bodies("chunk"))
    assert sorted(m["file"] for m in results.values()) == ["caf\ufffd.npy", "item-001.npy"]
    assert sorted(results) == [0, 1]
    assert (folder / "done" / latin).exists()


def test_folder_is_exactly_once_after_sigkill(
    broker: EmbeddedBroker,
    slow_repository: tuple[Path, float],
    tmp_path: Path,
    subscribe: Callable[..., Subscriber],
) -> None:
    """A subprocess agent killed with SIGKILL mid-way: files it had moved to done/ are never
    processed again; the rest are processed after the restart; seq never goes back."""
    repository, _ = slow_repository
    folder = tmp_path / "inbox"
    names = drop_files(folder, 60)
    device = f"k-{uuid.uuid4().hex[:8]}"
    config = tmp_path / "agent.toml"
    config.write_text(
        f'device_id = "{device}"\nstate_dir = "{tmp_path / "state"}"\nlog_level = "warning"\n'
        f'[mqtt]\nhost = "{broker.host}"\nport = {broker.port}\nreconnect_max_s = 0.5\n'
        f'[models]\nrepository = "{repository}"\n[telemetry]\ninterval_s = 0\n'
        "[metrics]\nenabled = false\n" + FOLDER_SOURCE.format(path=folder)
    )
    sub = subscribe(broker, f"edge/{device}/stream/inbox")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "agent.cli", "run", "--config", str(config)]
    first = subprocess.Popen(command, env=env)
    try:
        assert sub.wait_for(lambda ms: len(ms) >= 10, 30), "the agent produced nothing"
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(10)
    done_at_kill = {p.name for p in (folder / "done").iterdir()}
    assert 5 <= len(done_at_kill) < 60
    seq_before = max(m["seq"] for m in sub.bodies("chunk"))
    second = subprocess.Popen(command, env=env)
    try:
        finished = sub.wait_for(
            lambda ms: {m["file"] for m in ms if m.get("type") == "chunk"} >= set(names), 60
        )
        deadline = time.monotonic() + 10  # the last move follows its result
        while time.monotonic() < deadline and len(list((folder / "done").iterdir())) < 60:
            time.sleep(0.05)
    finally:
        second.send_signal(signal.SIGTERM)
        second.wait(30)
    assert finished, "not every file got a result after the restart"
    results = unique_seqs(sub.bodies("chunk"))
    by_file: dict[str, list[int]] = {}
    for seq, m in results.items():
        by_file.setdefault(m["file"], []).append(seq)
    assert set(by_file) == set(names)
    for name in done_at_kill:  # moved before the kill: one result, never run again
        assert len(by_file[name]) == 1, (name, by_file[name])
    rerun = {n: s for n, s in by_file.items() if len(s) > 1}
    assert len(rerun) <= 2, rerun  # only a file whose result was queued but not yet moved
    after = [s for s in results if s > seq_before]
    # The new run numbers above every seq the killed one may have used: from the bound it
    # had reserved (seq_reserve = 1000 ahead), never from a number already taken.
    assert after and seq_before < min(after) <= seq_before + 1 + 1000
    assert sorted(p.name for p in (folder / "done").iterdir()) == sorted(names)
    assert second.returncode == 0


# --------------------------------------------------------------------------- video


def make_video(path: Path, frames: int, size: tuple[int, int] = (64, 48)) -> list[np.ndarray]:
    """An MJPG .avi whose frame i is a flat colour that depends on i; returns what OpenCV
    reads back (the JPEG round trip changes pixels a little)."""
    assert cv2 is not None
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 10, size)
    assert writer.isOpened()
    for i in range(frames):
        image = np.zeros((size[1], size[0], 3), dtype=np.uint8)
        image[:, :, 0] = (i * 7) % 256
        image[:, :, 1] = (i * 13) % 256
        image[: size[1] // 2, :, 2] = 200
        writer.write(image)
    writer.release()
    capture = cv2.VideoCapture(str(path))
    read = []
    while True:
        ok, image = capture.read()
        if not ok:
            break
        read.append(image)
    capture.release()
    assert len(read) == frames
    return read


def reference_scores(frames: list[np.ndarray]) -> list[np.ndarray]:
    """conv_net on each frame, preprocessed by hand as NET_CONFIG says."""
    import onnxruntime as ort

    session = ort.InferenceSession(
        demo_models.to_bytes(demo_models.conv_net()), providers=["CPUExecutionProvider"]
    )
    scores = []
    for frame in frames:
        rgb = cv2.cvtColor(cv2.resize(frame, (32, 32)), cv2.COLOR_BGR2RGB).astype(np.float32)
        x = ((rgb / 255 - 0.5) / 0.25).transpose(2, 0, 1)[None].astype(np.float32)
        scores.append(session.run(None, {"image": x})[0])
    return scores


@needs_cv2
def test_video_file_is_processed_frame_by_frame(
    broker: EmbeddedBroker,
    slow_repository: tuple[Path, float],
    tmp_path: Path,
    subscribe: Callable[..., Subscriber],
) -> None:
    repository, _ = slow_repository
    video = tmp_path / "clip.avi"
    frames = make_video(video, 30)
    toml = f'[[sources]]\nname = "clip"\nkind = "video"\nmodel = "net"\npath = "{video}"\n'
    config = agent_config(tmp_path, broker, repository, toml)
    sub = subscribe(broker, f"{config.root_topic}/stream/clip")
    events = subscribe(broker, f"{config.root_topic}/events")
    for run in range(2):  # the second run plays the file again: seq goes on
        agent = Agent(config)
        agent.start()
        try:
            assert sub.wait_for(lambda ms, n=run: len(ms) >= 30 * (n + 1), 20), len(sub.messages)
            assert events.wait_for(
                lambda ms, n=run: sum(m["type"] == "source_finished" for m in ms) > n, 10
            )
        finally:
            agent.stop()
    chunks = sub.bodies("chunk")
    assert len(chunks) == 60
    assert [m["index"] for m in chunks] == list(range(30)) * 2  # frame numbers of each run
    seqs = [m["seq"] for m in chunks]
    assert seqs == list(range(seqs[0], seqs[0] + 60))  # contiguous, across the restart too
    want = reference_scores(frames)
    for m in chunks[:30]:
        got = outputs(m)["scores"]
        np.testing.assert_allclose(got, want[m["index"]], rtol=1e-4, atol=1e-4)
    assert {m["model"] for m in chunks} == {"net"}
    started = [m for m in events.bodies() if m["type"] == "source_started"]
    assert started and started[0]["source"] == "clip" and started[0]["kind"] == "video"


def test_video_without_opencv_fails_cleanly_and_the_agent_serves(
    broker: EmbeddedBroker,
    slow_repository: tuple[Path, float],
    tmp_path: Path,
    make_agent: Callable[..., Agent],
    make_client: Callable[..., Any],
    subscribe: Callable[..., Subscriber],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "cv2", None)
    repository, _ = slow_repository
    toml = (
        '[[sources]]\nname = "cam"\nkind = "video"\nmodel = "net"\ndevice = 0\n'
        "retry_min_s = 0.1\nretry_max_s = 0.2\n"
    )
    config = agent_config(tmp_path, broker, repository, toml)
    events = subscribe(broker, f"{config.root_topic}/events")
    agent = make_agent(broker, repository, toml=toml, DEVICE_ID=f'"{config.device_id}"')
    assert events.wait_for(lambda ms: sum(m["type"] == "source_failed" for m in ms) >= 2, 10)
    failed = [m for m in events.bodies() if m["type"] == "source_failed"]
    assert "OpenCV" in failed[0]["error"] and failed[0]["source"] == "cam"
    assert failed[1]["failures"] == 2 and failed[0]["retry_in_s"] <= 0.2
    client = make_client(broker, agent)
    client.infer("mlp", {"x": np.zeros((1, 16), dtype=np.float32)}, timeout=10)
    assert agent.sources.runner("cam").snapshot()["state"] == "failed"


CAMERA = "rtsp://admin:CamPa55word@127.0.0.1:1/stream1?token=TOK3N-abcdef"


@needs_cv2
def test_a_cameras_url_secrets_reach_no_event_log_or_printed_config(
    broker: EmbeddedBroker,
    slow_repository: tuple[Path, float],
    tmp_path: Path,
    make_agent: Callable[..., Agent],
    subscribe: Callable[..., Subscriber],
) -> None:
    """An IP camera's URL carries its password (and often a token): the source's failure
    event, check-config's output and the log's secrets mask them; user and host stay."""
    repository, _ = slow_repository
    toml = (
        f'[[sources]]\nname = "cam"\nkind = "video"\nmodel = "net"\nurl = "{CAMERA}"\n'
        "retry_min_s = 0.1\nretry_max_s = 0.2\n"
    )
    config = agent_config(tmp_path, broker, repository, toml)
    events = subscribe(broker, f"{config.root_topic}/events")
    make_agent(broker, repository, toml=toml, DEVICE_ID=f'"{config.device_id}"')
    assert events.wait_for(lambda ms: any(m["type"] == "source_failed" for m in ms), 20)
    failed = next(m for m in events.bodies() if m["type"] == "source_failed")
    assert "rtsp://admin:***@127.0.0.1:1/stream1?token=***" in failed["error"]
    printed = to_toml(masked_dict(config))
    assert "CamPa55word" not in printed and "TOK3N" not in printed and "admin:***@" in printed
    assert {"CamPa55word", "TOK3N-abcdef"} <= set(logs.config_secrets(config))


# --------------------------------------------------------------------------- pipe


def test_pipe_source_reads_a_cbor_sequence_from_a_fifo(
    broker: EmbeddedBroker,
    slow_repository: tuple[Path, float],
    tmp_path: Path,
    make_agent: Callable[..., Agent],
    subscribe: Callable[..., Subscriber],
) -> None:
    repository, _ = slow_repository
    fifo = tmp_path / "records.fifo"
    os.mkfifo(fifo)
    agent = make_agent(
        broker,
        repository,
        toml=f'[[sources]]\nname = "sensor"\nkind = "pipe"\nmodel = "mlp"\npath = "{fifo}"\n',
    )
    sub = subscribe(broker, f"{agent.root}/stream/sensor")
    rng = np.random.default_rng(3)
    batches = [rng.standard_normal((2, 16)).astype(np.float32) for _ in range(12)]

    def write(items: list[np.ndarray], bad_at: int | None = None) -> None:
        with open(fifo, "wb") as f:  # blocks until the agent has the FIFO open
            for i, x in enumerate(items):
                if i == bad_at:
                    f.write(cbor2.dumps({"x": "not a tensor"}))
                record = cbor2.dumps({"x": encode_tensor(x)})
                f.write(record[:5])  # records cut across writes are put back together
                f.flush()
                f.write(record[5:])

    write(batches[:6], bad_at=3)
    assert sub.wait_for(lambda ms: len(ms) >= 6, 10)
    write(batches[6:])  # a second writer on the same FIFO
    assert sub.wait_for(lambda ms: len(ms) >= 12, 10), len(sub.messages)
    chunks = sub.bodies("chunk")
    # Records are numbered as read: the bad one took index 3.
    assert [m["index"] for m in chunks] == [0, 1, 2, 4, 5, 6, *range(7, 13)]
    import onnxruntime as ort

    session = ort.InferenceSession(
        demo_models.to_bytes(demo_models.mlp()), providers=["CPUExecutionProvider"]
    )
    for m, x in zip(chunks, batches, strict=True):
        np.testing.assert_allclose(outputs(m)["y"], session.run(None, {"x": x})[0], rtol=1e-5)
    snap = agent.sources.runner("sensor").snapshot()
    assert snap["bad_inputs"] == 1 and snap["dropped"] == 0 and snap["state"] == "running"


def test_a_sources_backoff_never_goes_below_its_minimum() -> None:
    """The jitter took a delay down to half of `retry_min_s` (2.5 s between failures with
    `retry_min_s = 4`)."""
    from types import SimpleNamespace

    from agent.sources.runner import SourceRunner

    runner = SimpleNamespace(config=SimpleNamespace(retry_min_s=4.0, retry_max_s=30.0))
    delays = [SourceRunner._backoff(runner, attempt) for attempt in range(8) for _ in range(50)]  # type: ignore[arg-type]
    assert min(delays) >= 4.0 and max(delays) <= 30.0
    assert max(delays) > 15.0  # it still grows


class _FolderContext:
    def __init__(self, folder: Path) -> None:
        from agent.config import SourceConfig
        from agent.protocol.errors import Limits

        self.config = SourceConfig(
            name="f", kind="folder", model="m", path=folder, settle_s=0, poll_interval_s=0.01
        )
        self.limits = Limits()
        self.stop_event = threading.Event()

    def idle(self) -> None:
        pass


def test_a_file_replaced_while_queued_is_run_too_and_a_reopen_takes_nothing_twice(
    tmp_path: Path,
) -> None:
    """The file under the name was moved to `done/` whatever it was: one replaced while the
    first waited was never run. And a reader made again (a source reopened) took the files
    the first had queued a second time."""
    from agent.sources.readers.folder import FolderReader

    folder = tmp_path / "inbox"
    folder.mkdir()
    np.save(folder / "a.npy", np.zeros(2, np.float32))
    np.save(folder / "b.npy", np.zeros(2, np.float32))
    ctx = _FolderContext(folder)
    first = FolderReader(ctx, lambda message: None)
    records = first.records()
    a, b = next(records), next(records)  # both queued
    again = FolderReader(ctx, lambda message: None)  # reopened meanwhile
    assert [p.name for p, _ in again._candidates()] == []
    np.save(folder / "new.npy", np.ones(2, np.float32))
    os.replace(folder / "new.npy", folder / "a.npy")  # dropped again under its name
    assert a.on_done is not None and b.on_done is not None
    a.on_done("done")
    b.on_done("done")
    assert sorted(p.name for p in (folder / "done").iterdir()) == ["b.npy"]
    [(path, _)] = again._candidates()
    assert path.name == "a.npy" and np.load(path).tolist() == [1.0, 1.0]
