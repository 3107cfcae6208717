"""`mode = "scan"` with the real silero-vad model: a long recording cut into windows, the
state carried from window to window, one chunk per window (or per `windows_per_chunk`) with
its `index` and `offset`, equal to a plain onnxruntime loop; sessions that stream a
recording in pieces; the session store's rules."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from agent.client import AgentClient, AgentError
from agent.demo.broker import EmbeddedBroker
from agent.inference.scan import ScanCursor
from agent.inference.scan_sessions import ScanSessions
from agent.models.model_config import ModelConfigError, ScanConfig, parse_model_config
from agent.protocol.errors import WireError
from agent.service.agent import Agent
from tests.silero_helpers import HOP, LEAD, RATE, SILERO, WINDOW, reference, scan_config

MODELS = {
    "vad": "",
    "vad_pad": 'tail = "pad"',
    "vad4": "windows_per_chunk = 4",
}
TOL = {"rtol": 1e-5, "atol": 1e-5}


def make_signal(seed: int = 0, seconds: float = 3.0) -> npt.NDArray[np.float32]:
    """Seeded noise with a 440 Hz tone burst from 1 s to 2 s."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * RATE)) / RATE
    signal = 0.01 * rng.standard_normal(t.size)
    burst = (t >= 1.0) & (t < 2.0)
    signal[burst] += 0.5 * np.sin(2 * np.pi * 440 * t[burst])
    return signal.astype(np.float32)


@pytest.fixture(scope="module")
def scan_agent(
    broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Agent, AgentClient]]:
    from tests.conftest import agent_config, serve_agent

    tmp = tmp_path_factory.mktemp("scan")
    root = tmp / "models"
    for name, extra in MODELS.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.toml").write_text(scan_config(extra))
        shutil.copy(SILERO, root / name / "1" / "model.onnx")
    yield from serve_agent(broker, agent_config(tmp, broker, root), 20)


def chunks_of(client: AgentClient, model: str, inputs: dict[str, Any], **params: Any) -> list[Any]:
    return list(client.request(model, inputs, params=params or None, timeout=30))


def check_windows(chunks: list[Any], expected: npt.NDArray[Any], first: int = 0) -> None:
    """Chunks of one window each: index k, offset k*512, the reference's output k."""
    assert [c.index for c in chunks] == list(range(first, first + len(chunks)))
    assert [c.offset for c in chunks] == [k * HOP for k in range(first, first + len(chunks))]
    for chunk in chunks:
        np.testing.assert_allclose(chunk.outputs["output"], expected[chunk.index], **TOL)


@pytest.fixture(scope="module")
def signal() -> npt.NDArray[np.float32]:
    return make_signal()


@pytest.fixture(scope="module")
def expected(signal: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    return reference(signal[None])


def test_the_model_loads_and_warms_up(scan_agent: tuple[Agent, AgentClient]) -> None:
    agent, _ = scan_agent
    for name in MODELS:
        entry = agent.models.inventory()["models"][name]["versions"]["1"]
        assert entry["state"] == "ready", entry.get("error")
        assert entry["warmup"] == "ok"


def test_a_whole_recording_equals_the_plain_loop(
    scan_agent: tuple[Agent, AgentClient], signal: Any, expected: Any
) -> None:
    _, client = scan_agent
    chunks = chunks_of(client, "vad", {"input": signal[None]})
    assert len(chunks) == len(expected) == 93  # 48000 samples, the last 384 dropped
    check_windows(chunks, expected)
    assert set(chunks[0].outputs) == {"output"}  # the state output is carried, not sent
    assert all(0.0 <= c.outputs["output"][0, 0] <= 1.0 for c in chunks)  # probabilities


def test_five_session_pieces_equal_one_request(
    scan_agent: tuple[Agent, AgentClient], signal: Any, expected: Any
) -> None:
    _, client = scan_agent
    cuts = [0, 7000, 19345, 19348, 34000, signal.size]
    chunks: list[Any] = []
    for k in range(5):
        piece = signal[None, cuts[k] : cuts[k + 1]]
        got = chunks_of(client, "vad", {"input": piece}, session="rec-1", final=k == 4)
        if got:
            assert got[0].index == len(chunks)  # it goes on where the last one stopped
        chunks += got
    check_windows(chunks, expected)
    # the final piece ended the session: the same id starts a new recording at 0
    again = chunks_of(client, "vad", {"input": signal[None, :2000]}, session="rec-1")
    check_windows(again, expected)


def test_tail_pad_adds_the_last_partial_window(
    scan_agent: tuple[Agent, AgentClient], signal: Any
) -> None:
    _, client = scan_agent
    expected = reference(signal[None], pad=True)
    chunks = chunks_of(client, "vad_pad", {"input": signal[None]})
    assert len(chunks) == len(expected) == 94
    check_windows(chunks, expected)


def test_a_padded_recording_in_session_pieces(
    scan_agent: tuple[Agent, AgentClient], signal: Any
) -> None:
    _, client = scan_agent
    expected = reference(signal[None], pad=True)
    first = chunks_of(client, "vad_pad", {"input": signal[None, :10000]}, session="p")
    rest = chunks_of(client, "vad_pad", {"input": signal[None, 10000:]}, session="p", final=True)
    check_windows(first + rest, expected)


def test_windows_per_chunk_stacks_windows(
    scan_agent: tuple[Agent, AgentClient], signal: Any, expected: Any
) -> None:
    _, client = scan_agent
    chunks = chunks_of(client, "vad4", {"input": signal[None]})
    assert [c.index for c in chunks] == list(range(0, 93, 4))
    assert [c.offset for c in chunks] == [k * HOP for k in range(0, 93, 4)]
    assert chunks[0].outputs["output"].shape == (4, 1, 1)
    assert chunks[-1].outputs["output"].shape == (1, 1, 1)  # 93 = 23 * 4 + 1
    joined = np.concatenate([c.outputs["output"] for c in chunks])
    np.testing.assert_allclose(joined, expected, **TOL)


@pytest.mark.parametrize("model", ["vad", "vad4"])
def test_stream_false_gives_every_window_stacked(
    scan_agent: tuple[Agent, AgentClient], signal: Any, expected: Any, model: str
) -> None:
    _, client = scan_agent
    result = client.request(model, {"input": signal[None]}, stream=False).collect()
    assert result["output"].shape == (93, 1, 1)
    np.testing.assert_allclose(result["output"], expected, **TOL)


def test_a_batch_of_two_recordings(scan_agent: tuple[Agent, AgentClient], signal: Any) -> None:
    _, client = scan_agent
    both = np.stack([signal, make_signal(seed=7) * 0.5])
    expected = reference(both)
    chunks = chunks_of(client, "vad", {"input": both})
    assert chunks[0].outputs["output"].shape == (2, 1)
    check_windows(chunks, expected)
    for row in range(2):  # rows are independent recordings
        alone = reference(both[row : row + 1])
        np.testing.assert_allclose(expected[:, row], alone[:, 0], **TOL)


def test_params_outputs_with_scan(scan_agent: tuple[Agent, AgentClient], signal: Any) -> None:
    _, client = scan_agent
    chunks = chunks_of(client, "vad", {"input": signal[None, :4000]}, outputs=["output"])
    assert len(chunks) == 7 and all(set(c.outputs) == {"output"} for c in chunks)
    with pytest.raises(AgentError, match=r"params\.outputs"):
        chunks_of(client, "vad", {"input": signal[None, :4000]}, outputs=["stateN"])


def test_a_piece_shorter_than_a_window_gives_no_chunk(
    scan_agent: tuple[Agent, AgentClient], signal: Any, expected: Any
) -> None:
    _, client = scan_agent
    assert chunks_of(client, "vad", {"input": signal[None, :300]}, session="short") == []
    rest = chunks_of(client, "vad", {"input": signal[None, 300:1200]}, session="short")
    check_windows(rest, expected)


def test_session_parameters_are_checked(scan_agent: tuple[Agent, AgentClient], signal: Any) -> None:
    _, client = scan_agent
    piece = {"input": signal[None, :1000]}
    with pytest.raises(AgentError, match=r"params\.session"):
        chunks_of(client, "vad", piece, session="x" * 65)
    with pytest.raises(AgentError, match=r"params\.final"):
        chunks_of(client, "vad", piece, session="a", final="yes")
    chunks_of(client, "vad", piece, session="rows", final=False)
    two = {"input": np.repeat(signal[None, 1000:2000], 2, axis=0)}
    with pytest.raises(AgentError, match=r"bad_request: params\.session: samples of shape"):
        chunks_of(client, "vad", two, session="rows")  # another batch than its first piece


def test_a_recording_of_no_rows_is_refused_and_the_agent_serves_on(
    scan_agent: tuple[Agent, AgentClient], signal: Any, expected: Any
) -> None:
    """ONNX Runtime aborts the process on silero given a batch of none: refused at arrival."""
    agent, client = scan_agent
    with pytest.raises(AgentError, match=r"bad_request: input 'input' has no rows"):
        chunks_of(client, "vad", {"input": np.zeros((0, 2000), np.float32)})
    check_windows(chunks_of(client, "vad", {"input": signal[None, :1200]}), expected)
    assert agent.health_problem() is None


# -- the session store ---------------------------------------------------------------------

SCAN = ScanConfig(input="input", window=WINDOW, hop=HOP, lead=LEAD, session_ttl_s=10)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_session_is_kept_between_requests_and_busy_while_one_runs() -> None:
    sessions = ScanSessions()
    cursor = sessions.take("m", "s", 1, 10, ScanCursor.fresh(SCAN))
    with pytest.raises(WireError, match="session busy"):
        sessions.take("m", "s", 1, 10, ScanCursor.fresh(SCAN))
    cursor.windows(SCAN, np.zeros((1, 1000), np.float32), final=False)
    sessions.give_back("m", "s", cursor, keep=True)
    assert sessions.take("m", "s", 1, 10, ScanCursor.fresh(SCAN)) is cursor
    sessions.give_back("m", "s", cursor, keep=False)  # final: the session ends
    assert sessions.count("m") == 0


def test_a_session_on_another_version_is_refused_and_dropped() -> None:
    sessions = ScanSessions()
    cursor = sessions.take("m", "s", 1, 10, ScanCursor.fresh(SCAN))
    sessions.give_back("m", "s", cursor, keep=True)
    with pytest.raises(WireError, match="began on version 1"):
        sessions.take("m", "s", 2, 10, ScanCursor.fresh(SCAN))
    fresh = ScanCursor.fresh(SCAN)
    assert sessions.take("m", "s", 2, 10, fresh) is fresh


def test_sessions_expire_after_their_ttl() -> None:
    clock = Clock()
    sessions = ScanSessions(clock=clock)
    cursor = sessions.take("m", "s", 1, 10, ScanCursor.fresh(SCAN))
    sessions.give_back("m", "s", cursor, keep=True)
    clock.now = 9.0
    assert sessions.take("m", "s", 1, 10, ScanCursor.fresh(SCAN)) is cursor
    sessions.give_back("m", "s", cursor, keep=True)
    clock.now = 19.5
    fresh = ScanCursor.fresh(SCAN)
    assert sessions.take("m", "s", 1, 10, fresh) is fresh


def test_the_oldest_idle_session_goes_first() -> None:
    sessions = ScanSessions(max_per_model=2)
    for name in ("a", "b"):
        sessions.give_back(
            "m", name, sessions.take("m", name, 1, 10, ScanCursor.fresh(SCAN)), keep=True
        )
    sessions.take("m", "c", 1, 10, ScanCursor.fresh(SCAN))  # drops "a"
    fresh = ScanCursor.fresh(SCAN)
    assert sessions.take("m", "a", 1, 10, fresh) is fresh  # dropped "b" in turn
    with pytest.raises(WireError, match="too many"):  # "a" and "c" both busy
        sessions.take("m", "d", 1, 10, ScanCursor.fresh(SCAN))
    sessions.close()
    assert sessions.count("m") == 0


def _kept(sessions: ScanSessions, model: str, name: str, samples: int) -> ScanCursor:
    cursor = sessions.take(model, name, 1, 10, ScanCursor.fresh(SCAN))
    cursor.windows(SCAN, np.zeros((1, samples), np.float32), final=False)
    sessions.give_back(model, name, cursor, keep=True)
    return cursor


def test_a_quiet_models_sessions_expire_and_free_their_bytes() -> None:
    """Expiry swept only the model a request named: a model that went quiet (or was removed)
    kept its sessions' memory for good."""
    clock = Clock()
    sessions = ScanSessions(clock=clock)
    for name in ("a", "b"):
        _kept(sessions, "quiet", name, 1000)
    assert sessions.count("quiet") == 2 and sessions._bytes > 0
    clock.now = 11.0
    sessions.expire()  # what housekeeping calls every tick
    assert sessions.count("quiet") == 0 and sessions._bytes == 0


def test_the_byte_bound_drops_the_oldest_idle_session_of_any_model() -> None:
    """The bound is on all models' bytes, but only the named model's sessions were dropped:
    an old session of another model made a live one lose its recording at every piece."""
    probe = ScanSessions()
    one = _kept(probe, "m", "x", 1000).nbytes
    sessions = ScanSessions(max_bytes=2 * one)
    _kept(sessions, "stale", "old", 1000)
    live = _kept(sessions, "vad", "live", 1000)
    _kept(sessions, "vad", "new", 1000)  # over the bound: the stale model's session goes
    assert sessions.count("stale") == 0
    assert sessions.take("vad", "live", 1, 10, ScanCursor.fresh(SCAN)) is live


# -- the config ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[stream]\nmode = "scan"\n', "go together"),
        ('[scan]\ninput = "x"\nwindow = 4\nhop = 4\n', "go together"),
        ('[stream]\nmode = "scan"\n[scan]\ninput = "x"\nwindow = 4\nhop = 5\n', "hop 5"),
        ('[stream]\nmode = "scan"\n[scan]\ninput = "x"\nwindow = 4\nhop = 2\nlead = 4\n', "lead"),
        (
            '[stream]\nmode = "scan"\nfeed = { a = "b" }\n'
            '[scan]\ninput = "x"\nwindow = 4\nhop = 2\n',
            'feed only apply to mode = "steps"',
        ),
        (
            '[stream]\nmode = "scan"\n[scan]\ninput = "x"\nwindow = 4\nhop = 2\n'
            "[batching]\nmax_batch = 4\n",
            "batching applies",
        ),
        ('[stream]\nstate = { a = "b" }\n', 'state only apply to mode = "steps"'),
    ],
)
def test_scan_config_errors(text: str, message: str) -> None:
    with pytest.raises(ModelConfigError, match=message):
        parse_model_config(text, "config.toml")


def test_scan_config_with_state() -> None:
    config = parse_model_config(scan_config(), "config.toml")
    assert config.stream.mode == "scan" and config.stream.state == {"state": "stateN"}
    assert config.scan == ScanConfig(input="input", window=576, hop=512, lead=64)
    assert config.defaults == {"sr": 16000}
