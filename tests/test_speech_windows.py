"""A speech recogniser over windows: a scan request, a session's pieces and a live pcm source
cut a recording into the model's `[scan]` windows; each window is normalised on its own, as
Hugging Face's chunked speech pipeline (`chunk_length_s`) runs its feature extractor on each
chunk, then run and decoded by `ctc`. The references (`tests/fixtures/real/wav2vec2/windows.json`
and `windows.npz`, from `scripts/make_speech_models.py`) are the processor, the PyTorch model
and `batch_decode` on each window as the agent cuts it."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.client import AgentClient
from agent.demo.broker import EmbeddedBroker
from agent.service.agent import Agent
from tests.conftest import agent_config
from tests.test_sources import Subscriber, outputs, subscribe, unique_seqs

__all__ = ["subscribe"]  # the fixture, used by name

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "real" / "wav2vec2"
WINDOWS: dict[str, Any] = json.loads((FIXTURE / "windows.json").read_text(encoding="utf-8"))
WINDOW_LOGITS = np.load(FIXTURE / "windows.npz")["logits"]  # [windows, 1, frames, classes]
SIGNAL = np.load(FIXTURE / "signal.npy")  # [samples] float32, as recorded
WINDOW, HOP, LEAD = WINDOWS["window"], WINDOWS["hop"], WINDOWS["lead"]
SCAN = (
    f'[stream]\nmode = "scan"\n[scan]\ninput = "input_values"\n'
    f"window = {WINDOW}\nhop = {HOP}\nlead = {LEAD}\n"
)
CTC = '[[postprocess]]\noutput = "logits"\nop = "ctc"\nlabels = "vocab.json"\n'
LOGITS = {"rtol": 1e-3, "atol": 1e-3}  # ONNX Runtime and PyTorch differ by about 1e-4 here


def speech_repository(root: Path) -> Path:
    models = {
        "asr": SCAN + CTC,
        "asr_logits": SCAN,
        "asr_two": f"{SCAN}windows_per_chunk = 2\n{CTC}",
    }
    for name, config in models.items():
        shutil.copytree(FIXTURE, root / name / "1", ignore=shutil.ignore_patterns("ref*", "sig*"))
        (root / name / "config.toml").write_text(config)
    return root


@pytest.fixture(scope="module")
def speech_agent(
    broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Agent, AgentClient]]:
    from tests.conftest import serve_agent

    tmp = tmp_path_factory.mktemp("speech-windows")
    root = speech_repository(tmp / "models")
    yield from serve_agent(broker, agent_config(tmp, broker, root))


def chunks(client: AgentClient, model: str, samples: np.ndarray, **params: Any) -> list[Any]:
    reply = client.request(model, {"input_values": samples[None]}, params=params or None)
    return list(reply)


def test_the_fixture_windows_are_the_scans() -> None:
    """The references cut the recording as `[scan]` does: window k covers samples
    `[k * hop - lead, k * hop - lead + window)`, zeros before the first; none is partial."""
    count = (len(SIGNAL) + LEAD - WINDOW) // HOP + 1
    assert WINDOWS["starts"] == [k * HOP for k in range(count)]
    assert len(WINDOWS["texts"]) == count == len(WINDOW_LOGITS)
    assert len(set(WINDOWS["texts"])) > 1  # windows that say different things


def test_each_window_is_normalised_as_the_pipeline_normalises_a_chunk(
    speech_agent: tuple[Agent, AgentClient],
) -> None:
    """The samples as recorded give, window by window, Hugging Face's logits for the window
    normalised on its own (not the recording's normalisation, nor none)."""
    _, client = speech_agent
    got = chunks(client, "asr_logits", SIGNAL)
    assert [c.offset for c in got] == WINDOWS["starts"]
    for chunk, want in zip(got, WINDOW_LOGITS, strict=True):
        np.testing.assert_allclose(chunk.outputs["logits"], want, **LOGITS)


def test_each_window_is_decoded_to_its_text(speech_agent: tuple[Agent, AgentClient]) -> None:
    _, client = speech_agent
    got = chunks(client, "asr", SIGNAL)
    assert [c.outputs["logits_text"].tolist() for c in got] == [[t] for t in WINDOWS["texts"]]
    assert [c.index for c in got] == list(range(len(WINDOWS["texts"])))


def test_two_windows_a_chunk_are_each_decoded(speech_agent: tuple[Agent, AgentClient]) -> None:
    """`windows_per_chunk = 2`: the ops run on each window, their texts stacked on a leading
    axis (not the ops on the stacked logits, which no CTC decode takes)."""
    _, client = speech_agent
    got = chunks(client, "asr_two", SIGNAL)
    assert [c.offset for c in got] == WINDOWS["starts"][::2]
    assert [c.outputs["logits_text"].shape for c in got] == [(2, 1)] * len(got)
    texts = [text for c in got for text in c.outputs["logits_text"][:, 0].tolist()]
    assert texts == WINDOWS["texts"]


def test_a_session_in_pieces_gives_the_same_windows(
    speech_agent: tuple[Agent, AgentClient],
) -> None:
    """Pieces cut anywhere (a window across two of them) give the windows of one request: a
    window is normalised once it is whole, not per piece."""
    _, client = speech_agent
    cuts = [0, 7001, 13000, 25555, len(SIGNAL)]
    texts = []
    for k in range(len(cuts) - 1):
        piece = SIGNAL[cuts[k] : cuts[k + 1]]
        final = k == len(cuts) - 2
        for chunk in chunks(client, "asr", piece, session="utterance-1", final=final):
            texts.append((chunk.offset, chunk.outputs["logits_text"].tolist()[0]))
    assert texts == list(zip(WINDOWS["starts"], WINDOWS["texts"], strict=True))


def pcm_source(name: str, path: Path, rate: int, **keys: Any) -> str:
    lines = [
        f'[[sources]]\nname = "{name}"\nkind = "pcm"\nmodel = "asr"\npath = "{path}"\n',
        f'format = "f32le"\nsample_rate = {rate}\n',
    ]
    lines += [f"{key} = {value}\n" for key, value in keys.items()]
    return "".join(lines)


@pytest.fixture
def start_source(
    broker: EmbeddedBroker,
    tmp_path: Path,
    make_agent: Callable[..., Agent],
    subscribe: Callable[..., Subscriber],
) -> Callable[..., tuple[Agent, Subscriber, Subscriber]]:
    """An agent with one pcm source reading the recording as float32 from a file, its events
    and the source's stream subscribed before it starts."""
    root = speech_repository(tmp_path / "models")
    recording = tmp_path / "signal.f32"
    recording.write_bytes(SIGNAL.astype("<f4").tobytes())

    def start(rate: int = WINDOWS["rate"], **keys: Any) -> tuple[Agent, Subscriber, Subscriber]:
        toml = pcm_source("mic", recording, rate, **keys)
        config = agent_config(tmp_path, broker, root, toml)
        events = subscribe(broker, f"{config.root_topic}/events")
        stream = subscribe(broker, f"{config.root_topic}/stream/mic")
        agent = make_agent(broker, root, toml=toml, DEVICE_ID=f'"{config.device_id}"')
        return agent, events, stream

    return start


def test_a_live_source_gives_each_windows_text(
    start_source: Callable[..., tuple[Agent, Subscriber, Subscriber]],
) -> None:
    """A pcm source over the same samples publishes, window by window, the text of the
    `[[postprocess]]` (`ctc`) of the window normalised on its own, at its offset."""
    _, events, stream = start_source()
    assert events.wait_for(lambda ms: any(m["type"] == "source_finished" for m in ms), 30)
    count = len(WINDOWS["texts"])
    assert stream.wait_for(lambda ms: len(unique_seqs(ms)) >= count, 10)
    seen = unique_seqs(stream.bodies("chunk"))
    got = [seen[seq] for seq in sorted(seen)]
    assert [m["offset"] for m in got] == WINDOWS["starts"]
    assert [outputs(m)["logits_text"].tolist() for m in got] == [[t] for t in WINDOWS["texts"]]


def test_windows_of_a_chunk_are_each_decoded(
    start_source: Callable[..., tuple[Agent, Subscriber, Subscriber]],
) -> None:
    """Two windows a message: each window decoded, the texts stacked on a leading axis."""
    _, events, stream = start_source(windows_per_chunk=2)
    assert events.wait_for(lambda ms: any(m["type"] == "source_finished" for m in ms), 30)
    count = -(-len(WINDOWS["texts"]) // 2)
    assert stream.wait_for(lambda ms: len(unique_seqs(ms)) >= count, 10)
    seen = unique_seqs(stream.bodies("chunk"))
    texts = [text for seq in sorted(seen) for text in outputs(seen[seq])["logits_text"][:, 0]]
    assert texts == WINDOWS["texts"]


def test_a_source_at_another_rate_than_the_feature_extractors_is_refused(
    start_source: Callable[..., tuple[Agent, Subscriber, Subscriber]],
) -> None:
    agent, events, stream = start_source(rate=8000, retry_min_s=5, retry_max_s=5)
    assert events.wait_for(lambda ms: any(m["type"] == "source_failed" for m in ms), 10)
    assert agent.sources.runner("mic").snapshot()["state"] == "failed"
    failed = next(m for m in events.bodies() if m["type"] == "source_failed")
    assert "sample_rate = 8000 does not match model 'asr'" in failed["error"], failed
    assert "preprocessor_config.json: sampling_rate 16000" in failed["error"]
    assert not stream.bodies("chunk")
