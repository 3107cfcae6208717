"""A pcm source through a speech recogniser (`agent.sources.transcribe`): the windows of a
recording transcribed one a message, equal to Hugging Face's `generate` for each window alone,
and with the previous window's text as the prompt, equal to a request that sends it. The
Whisper fixture and its references come from `scripts/make_whisper.py`."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.config import ConfigError, load_config
from agent.demo.broker import EmbeddedBroker
from agent.service.agent import Agent
from tests.conftest import agent_config
from tests.silero_helpers import SILERO, scan_config
from tests.test_generate_whisper import language_of
from tests.test_pcm_source import chunks_of, no_leaked_source_threads
from tests.test_sources import Subscriber, outputs, subscribe

__all__ = ["no_leaked_source_threads", "subscribe"]  # fixtures, used by name

pytest.importorskip("tokenizers")

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "real" / "whisper"
REFERENCE: dict[str, Any] = json.loads((FIXTURES / "reference.json").read_text(encoding="utf-8"))
ARRAYS = dict(np.load(FIXTURES / "reference.npz"))
N = int(REFERENCE["new_tokens"])
WINDOW = 64000  # 4 s: each clip of the fixture, padded with silence, is one window
CLIPS = ("sweep", "chord")


def detected(clip: str) -> dict[str, Any]:
    """The reference of `clip` transcribed with neither language nor task asked."""
    return next(
        c
        for c in REFERENCE["cases"]
        if c["clip"] == clip and c["language"] is None and c["task"] is None
    )


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A models folder with the Whisper export, and the clips one after another, each
    padded to a window, as a float32 file."""
    tmp = tmp_path_factory.mktemp("transcribe")
    shutil.copytree(FIXTURES, tmp / "models" / "whisper" / "1", ignore=_references)
    (tmp / "models" / "whisper" / "config.toml").write_text('[stream]\nmode = "generate"\n')
    (tmp / "models" / "vad" / "1").mkdir(parents=True)  # a scan model
    shutil.copy(SILERO, tmp / "models" / "vad" / "1" / "model.onnx")
    (tmp / "models" / "vad" / "config.toml").write_text(scan_config())
    samples = np.zeros(WINDOW * len(CLIPS), dtype="<f4")
    for k, clip in enumerate(CLIPS):
        audio = ARRAYS[f"audio_{clip}"]
        samples[k * WINDOW : k * WINDOW + audio.size] = audio
    (tmp / "clips.f32").write_bytes(samples.tobytes())
    return tmp / "models", tmp / "clips.f32"


def _references(folder: str, names: list[str]) -> list[str]:
    return [n for n in names if n.startswith("reference.")]


def source(path: Path, model: str = "whisper", **keys: Any) -> str:
    lines = [f'[[sources]]\nname = "mic"\nkind = "pcm"\nmodel = "{model}"\npath = "{path}"\n']
    keys = {"format": '"f32le"', "sample_rate": 16000, "window": WINDOW, **keys}
    given = [f"{key} = {value}\n" for key, value in keys.items() if value is not None]
    return "".join(lines + given)


def start(
    broker: EmbeddedBroker,
    tmp_path: Path,
    models: Path,
    toml: str,
    make_agent: Callable[..., Agent],
    subscribe: Callable[..., Subscriber],
) -> tuple[Agent, Subscriber, Subscriber]:
    config = agent_config(tmp_path, broker, models, toml)
    events = subscribe(broker, f"{config.root_topic}/events")
    sub = subscribe(broker, f"{config.root_topic}/stream/mic")
    agent = make_agent(broker, models, toml=toml, DEVICE_ID=f'"{config.device_id}"')
    return agent, events, sub


def finished(events: Subscriber) -> bool:
    return events.wait_for(lambda ms: any(m["type"] == "source_finished" for m in ms), 60)


def test_each_window_alone_equals_hugging_face(
    broker: EmbeddedBroker,
    tmp_path: Path,
    recording: tuple[Path, Path],
    make_agent: Callable[..., Agent],
    subscribe: Callable[..., Subscriber],
) -> None:
    """`previous_text = false`: every window is a request of its own, its language detected:
    Hugging Face's tokens and text for each clip, one message a window at its offset."""
    models, path = recording
    toml = source(path, previous_text="false", params=f"{{ max_new_tokens = {N} }}")
    agent, events, sub = start(broker, tmp_path, models, toml, make_agent, subscribe)
    assert finished(events)
    assert sub.wait_for(lambda ms: len(ms) >= len(CLIPS), 10)
    chunks = chunks_of(sub)
    assert [m["offset"] for m in chunks] == [k * WINDOW for k in range(len(CLIPS))]
    for message, clip in zip(chunks, CLIPS, strict=True):
        ref = detected(clip)
        assert outputs(message)["tokens"].tolist() == ref["tokens"]
        assert message["text"] == ref["text"]
        assert message["finish_reason"] == ref["finish"]
        assert message["language"] == language_of(ref)  # detected
    assert agent.sources.runner("mic").snapshot()["state"] == "finished"


def test_a_window_reads_the_text_of_the_one_before(
    broker: EmbeddedBroker,
    tmp_path: Path,
    recording: tuple[Path, Path],
    make_agent: Callable[..., Agent],
    make_client: Callable[..., Any],
    subscribe: Callable[..., Subscriber],
) -> None:
    """By default the second window's prompt is the first one's text: what a request of that
    window with that text as `inputs.prompt` answers, and not the window alone."""
    models, path = recording
    params = f'{{ max_new_tokens = {N}, language = "en" }}'
    agent, events, sub = start(
        broker, tmp_path, models, source(path, params=params), make_agent, subscribe
    )
    assert finished(events)
    assert sub.wait_for(lambda ms: len(ms) >= len(CLIPS), 10)
    first, second = chunks_of(sub)
    client = make_client(broker, agent)
    window = np.fromfile(path, dtype="<f4")[WINDOW:]
    asked = {"max_new_tokens": N, "language": "en"}
    alone = client.request("whisper", {"input_values": window}, params=asked, stream=False)
    after = client.request(
        "whisper",
        {"input_values": window, "prompt": first["text"]},
        params=asked,
        stream=False,
    )
    assert outputs(second)["tokens"].tolist() == after.collect()["tokens"].tolist()
    assert second["text"] == after.text
    assert after.collect()["tokens"].tolist() != alone.collect()["tokens"].tolist()


def test_the_example_config_loads() -> None:
    repo = Path(__file__).resolve().parent.parent
    config = load_config(repo / "configs" / "whisper-mic.toml", environ={})
    (mic,) = config.sources
    assert (
        mic.kind == "pcm"
        and mic.window == 80000
        and mic.params
        == {
            "language": "en",
            "max_new_tokens": 96,
        }
    )


def test_speech_keys_are_refused_for_other_kinds(tmp_path: Path) -> None:
    toml = tmp_path / "agent.toml"
    toml.write_text(
        '[[sources]]\nname = "cam"\nkind = "video"\nmodel = "m"\ndevice = 0\nwindow = 9\n'
    )
    with pytest.raises(ConfigError, match='window: not for kind = "video"'):
        load_config(toml, environ={})


def test_the_previous_text_starts_empty_when_the_source_reopens(
    broker: EmbeddedBroker,
    tmp_path: Path,
    recording: tuple[Path, Path],
    make_agent: Callable[..., Agent],
    subscribe: Callable[..., Subscriber],
) -> None:
    """A command that writes the recording and exits is started again: the first window of
    each opening reads no previous text (Hugging Face's answer for that window alone), at
    offset 0 again; the second reads the first one's."""
    models, path = recording
    script = f"import sys; sys.stdout.buffer.write(open({str(path)!r}, 'rb').read())"
    command = f"[{sys.executable!r}, '-c', {script!r}]"
    toml = source(path, params=f"{{ max_new_tokens = {N} }}", retry_min_s=0.2, retry_max_s=0.3)
    toml = toml.replace(f'path = "{path}"', f"command = {command}")
    _, _, sub = start(broker, tmp_path, models, toml, make_agent, subscribe)
    assert sub.wait_for(lambda ms: len(ms) >= 2 * len(CLIPS), 60), len(sub.messages)
    chunks = chunks_of(sub)[: 2 * len(CLIPS)]
    first = detected(CLIPS[0])
    for opening in (chunks[:2], chunks[2:]):
        assert [m["offset"] for m in opening] == [0, WINDOW]
        assert outputs(opening[0])["tokens"].tolist() == first["tokens"]
    assert outputs(chunks[1])["tokens"].tolist() == outputs(chunks[3])["tokens"].tolist()


def test_a_silent_window_is_not_run_and_the_text_after_it_starts_afresh(
    broker: EmbeddedBroker,
    tmp_path: Path,
    recording: tuple[Path, Path],
    make_agent: Callable[..., Agent],
    subscribe: Callable[..., Subscriber],
) -> None:
    """`silence_dbfs = -60`: a window of silence between the clips gives a message without
    tokens, `silent: true`; the window after it reads no previous text (Hugging Face's answer
    for its clip alone), though `previous_text` is on."""
    models, path = recording
    clips = np.fromfile(path, dtype="<f4")
    gapped = tmp_path / "gapped.f32"
    gapped.write_bytes(np.concatenate([clips[:WINDOW], np.zeros(WINDOW, "<f4"), clips[WINDOW:]]))
    params = f"{{ max_new_tokens = {N} }}"
    toml = source(gapped, params=params, silence_dbfs=-60)
    _, events, sub = start(broker, tmp_path, models, toml, make_agent, subscribe)
    assert finished(events)
    assert sub.wait_for(lambda ms: len(ms) >= 3, 10)
    first, silent, last = chunks_of(sub)
    assert outputs(first)["tokens"].tolist() == detected(CLIPS[0])["tokens"]
    assert silent["silent"] is True and silent["text"] == ""
    assert outputs(silent)["tokens"].size == 0 and silent["offset"] == WINDOW
    assert outputs(last)["tokens"].tolist() == detected(CLIPS[1])["tokens"]
    assert "silent" not in first and "silent" not in last


@pytest.mark.parametrize(
    ("keys", "says"),
    [
        ({"window": None}, "transcribes windows of the source's window = N samples, 1 to 480000"),
        ({"window": 480001}, "1 to 480000"),
        ({"params": '{ language = "xx" }'}, "params: params.language: 'xx' is not one"),
        ({"sample_rate": 8000}, "sample_rate = 8000 does not match model 'whisper'"),
        ({"channels": 2}, "transcribes mono windows"),
        ({"model": "vad"}, "window: for a speech recogniser; a scan model's windows are"),
    ],
)
def test_a_source_the_recogniser_cannot_take_fails_and_says_why(
    broker: EmbeddedBroker,
    tmp_path: Path,
    recording: tuple[Path, Path],
    make_agent: Callable[..., Agent],
    subscribe: Callable[..., Subscriber],
    keys: dict[str, Any],
    says: str,
) -> None:
    models, path = recording
    keys = dict(keys)
    model = keys.pop("model", "whisper")
    toml = source(path, model, retry_min_s=5, retry_max_s=5, **keys)
    _, events, sub = start(broker, tmp_path, models, toml, make_agent, subscribe)
    assert events.wait_for(lambda ms: any(m["type"] == "source_failed" for m in ms), 30)
    failed = next(m for m in events.bodies() if m["type"] == "source_failed")
    assert says in failed["error"], failed
    assert not sub.bodies("chunk")


def test_the_previous_text_is_cut_to_half_the_context_in_tokens() -> None:
    """A long previous text, of characters that are several byte-level tokens each: the prompt
    keeps its end, at most half the context less one in tokens (223 of Whisper's 448)."""
    from agent.config import SourceConfig
    from agent.inference import speech
    from agent.models.backends.base import BackendOptions
    from agent.models.backends.onnxruntime import OnnxRuntimeBackend
    from agent.models.decoder_layout import open_generation
    from agent.sources.transcribe import Transcriber

    backend, options = OnnxRuntimeBackend(), BackendOptions(1)
    session = backend.load(FIXTURES / "model.onnx", options)
    setup = open_generation(None, session, FIXTURES, lambda f: backend.load(f, options))
    try:
        assert setup.context == 448 and setup.tokenizer is not None
        config = SourceConfig(
            name="mic", kind="pcm", model="whisper", path=Path("x"), sample_rate=16000
        )
        transcriber = Transcriber(config)
        transcriber.previous = "début " + "日本語 café 🙂 " * 200 + "the end"
        kept = speech.tail(transcriber.previous, setup)
        assert transcriber.previous.endswith(kept) and kept.endswith("the end")
        assert len(setup.tokenizer.encode(" " + kept, special=False)) <= 223
        transcriber.previous = "short"
        assert speech.tail(transcriber.previous, setup) == "short"
    finally:
        setup.close()
        session.close()
