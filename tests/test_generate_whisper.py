"""`mode = "generate"` with a Whisper speech recogniser exported by optimum
(`automatic-speech-recognition-with-past`), as a user copies optimum's folder
(`encoder_model.onnx` reading log-mel features, the merged decoder as `model.onnx`, the
configs, the feature extractor's `preprocessor_config.json` and the tokenizer): the agent's
log-mel features equal `WhisperFeatureExtractor`'s, and its greedy tokens, text and finish equal
Hugging Face's `generate(do_sample=False)` for a language and task asked, for a task alone,
and for neither (the language detected, the checkpoint's forced task); the config's suppressed
tokens are never chosen; bad recordings and unknown languages are refused. The fixture and its
references come from `scripts/make_whisper.py`."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.client import AgentClient, AgentError
from agent.demo.broker import EmbeddedBroker
from agent.inference import generate as generate_mode
from agent.inference.generate_lockstep import LockstepBatch
from agent.models.backends.base import BackendOptions
from agent.models.backends.onnxruntime import OnnxRuntimeBackend
from agent.models.decoder_layout import open_generation, recognise
from agent.models.generate_config import GenerateConfig
from agent.models.log_mel import open_log_mel
from agent.models.speech_prompt import SpeechPrompt
from agent.service.agent import Agent
from tests.generate_helpers import streamed, tokens_by_member, tokens_of

pytest.importorskip("tokenizers")

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "real" / "whisper"
REFERENCE: dict[str, Any] = json.loads((FIXTURES / "reference.json").read_text(encoding="utf-8"))
ARRAYS = dict(np.load(FIXTURES / "reference.npz"))
N = int(REFERENCE["new_tokens"])
IDS: dict[str, int] = REFERENCE["ids"]
GENERATE = '[stream]\nmode = "generate"\n'
# Requests queued within 0.3 s share runs: their steps in lock-step, a row each.
BATCHING = "[batching]\nmax_batch = 4\nmax_queue_delay_us = 300000\n"
MODELS = {  # name: config.toml after GENERATE, and what is done to the folder
    "whisper": "",
    "whisper_batched": BATCHING,
    "whisper_eos": "[generate]\neos = [{eos}]\n",  # a token of the reference as the eos
    "whisper_no_extractor": "",
    "whisper_other_mels": "",
}


def _eos_case() -> tuple[dict[str, Any], int]:
    """A reference case and the position of a token that first appears there (past the
    first), taken as the eos: its generation ends with that token."""
    case = REFERENCE["cases"][0]
    tokens = case["tokens"]
    at = next(k for k in range(1, len(tokens)) if tokens[k] not in tokens[:k])
    return case, at


@pytest.fixture(scope="module")
def agent_client(
    broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Agent, AgentClient]]:
    from tests.conftest import agent_config, serve_agent

    tmp = tmp_path_factory.mktemp("whisper")
    root = tmp / "models"
    case, at = _eos_case()
    for name, extra in MODELS.items():
        folder = root / name / "1"
        shutil.copytree(FIXTURES, folder, ignore=shutil.ignore_patterns("reference.*"))
        config = GENERATE + extra.format(eos=case["tokens"][at])
        (root / name / "config.toml").write_text(config)
    (root / "whisper_no_extractor" / "1" / "preprocessor_config.json").unlink()
    extractor = root / "whisper_other_mels" / "1" / "preprocessor_config.json"
    settings = json.loads(extractor.read_text())
    extractor.write_text(json.dumps({**settings, "feature_size": 128}))
    yield from serve_agent(broker, agent_config(tmp, broker, root), 20)


def language_of(ref: dict[str, Any]) -> str:
    """The language token Hugging Face's prompt holds after its start token, as a code."""
    heard = ref["prompt"][ref["prompt"].index(IDS["<|startoftranscript|>"]) + 1]
    return next(code for code in ("en", "de", "fr") if IDS[f"<|{code}|>"] == heard)


def request_of(ref: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The inputs and params of a reference case's request: its clip's samples, its previous
    text, its language and task (those it names), `max_new_tokens`."""
    inputs: dict[str, Any] = {"input_values": ARRAYS[f"audio_{ref['clip']}"]}
    if ref["text_prompt"] is not None:
        inputs["prompt"] = ref["text_prompt"]
    params: dict[str, Any] = {"max_new_tokens": N}
    params.update({k: ref[k] for k in ("language", "task") if ref[k] is not None})
    return inputs, params


def test_the_features_equal_the_feature_extractors() -> None:
    """`WhisperFeatureExtractor` ran PyTorch's STFT in float32 for the references; the agent's
    numpy one (float64, as the extractor's numpy path) differs in the last digits only."""
    log_mel = open_log_mel(FIXTURES)
    assert log_mel is not None
    for clip in ("sweep", "chord", "bursts"):
        made = log_mel.features(ARRAYS[f"audio_{clip}"])
        assert made.dtype == np.float32 and made.shape == (1, 80, 3000)
        np.testing.assert_allclose(made, ARRAYS[f"features_{clip}"], atol=1e-4, rtol=0)


def test_the_export_loads_and_the_broken_ones_say_why(
    agent_client: tuple[Agent, AgentClient],
) -> None:
    agent, _ = agent_client
    models = agent.models.inventory()["models"]
    versions = {name: m["versions"]["1"] for name, m in models.items()}
    assert versions["whisper"]["state"] == "ready", versions["whisper"]
    assert versions["whisper"]["text_inputs"] == ["input_values", "input_features", "prompt"]
    assert versions["whisper_no_extractor"]["state"] == "failed"
    assert (
        "preprocessor_config.json of a WhisperFeatureExtractor"
        in (versions["whisper_no_extractor"]["error"])
    )
    assert versions["whisper_other_mels"]["state"] == "failed"
    assert "is not [batch, 128, 3000]" in versions["whisper_other_mels"]["error"]


@pytest.mark.parametrize("case", range(len(REFERENCE["cases"])))
def test_greedy_tokens_and_text_equal_hugging_face(
    agent_client: tuple[Agent, AgentClient], case: int
) -> None:
    """The recording's samples in, the prompt laid out as Whisper's `generate` lays it out
    (the language asked, or detected; the task asked, or the checkpoint's; a previous text
    before it, as `prompt_ids`), its tokens, text and finish out."""
    _, client = agent_client
    ref = REFERENCE["cases"][case]
    inputs, params = request_of(ref)
    reply, chunks = streamed(client, "whisper", inputs, **params)
    assert tokens_of(chunks) == ref["tokens"]
    assert "".join(c.text for c in chunks) == ref["text"]
    assert reply.end.finish_reason == ref["finish"]
    assert reply.end.usage == {"prompt_tokens": len(ref["prompt"]), "completion_tokens": N}
    assert reply.end.language == language_of(ref)  # asked, or detected


@pytest.mark.parametrize("case", range(len(REFERENCE["cases"])))
def test_beam_search_equals_hugging_face(
    agent_client: tuple[Agent, AgentClient], case: int
) -> None:
    """`params.num_beams = 3`: `generate(num_beams=3)`'s tokens, the prompt laid out (and the
    language detected) as for greedy, the suppressed tokens barred on every beam."""
    _, client = agent_client
    ref = REFERENCE["cases"][case]
    inputs, params = request_of(ref)
    _, chunks = streamed(client, "whisper", inputs, num_beams=3, **params)
    assert tokens_of(chunks) == ref["beam"]


def test_the_cases_cover_detection_and_every_prompt_rule() -> None:
    """The references hold a detected language unlike the one asked elsewhere, a task asked
    without a language, and a language without a task (transcription added)."""
    cases = REFERENCE["cases"]
    sot = IDS["<|startoftranscript|>"]
    detected = {c["prompt"][c["prompt"].index(sot) + 1] for c in cases if c["language"] is None}
    asked = {IDS[f"<|{c['language']}|>"] for c in cases if c["language"] is not None}
    assert detected and detected <= set(IDS[f"<|{code}|>"] for code in ("en", "de", "fr"))
    translate = [c for c in cases if c["task"] == "translate" and c["language"] is None]
    assert translate and translate[0]["prompt"][2] == IDS["<|translate|>"]
    alone = [c for c in cases if c["language"] is not None and c["task"] is None]
    assert alone and alone[0]["prompt"][2] == IDS["<|transcribe|>"]
    assert asked - detected, "a language asked that detection would not give"
    previous = [c for c in cases if c["text_prompt"] is not None]
    assert {c["language"] is None for c in previous} == {True, False}
    assert all(c["prompt"][0] == IDS["<|startofprev|>"] for c in previous)
    for case in previous:  # the previous text changes the transcription
        plain = next(c for c in cases if c["text_prompt"] is None and c["clip"] == case["clip"])
        assert case["tokens"] != plain["tokens"]


def test_features_in_equal_samples_in(agent_client: tuple[Agent, AgentClient]) -> None:
    _, client = agent_client
    ref = REFERENCE["cases"][2]
    features = ARRAYS[f"features_{ref['clip']}"]
    params = {"max_new_tokens": N, "language": ref["language"], "task": ref["task"]}
    _, chunks = streamed(client, "whisper", {"input_features": features}, **params)
    assert tokens_of(chunks) == ref["tokens"]


@pytest.mark.parametrize("model", ["whisper", "whisper_batched"])
def test_concurrent_transcriptions_and_one_result(
    agent_client: tuple[Agent, AgentClient], model: str
) -> None:
    """Four requests at once (each detecting its language or not; in lock-step under
    `[batching]`) each get their own tokens; `stream: false` gives them in one result with
    the whole text."""
    _, client = agent_client
    refs = REFERENCE["cases"][:4]
    replies = []
    for ref in refs:
        inputs, params = request_of(ref)
        replies.append(client.request(model, inputs, params=params, timeout=30))
    for ref, reply in zip(refs, replies, strict=True):
        assert tokens_of(list(reply)) == ref["tokens"]
    ref = REFERENCE["cases"][1]
    samples = {"input_values": ARRAYS[f"audio_{ref['clip']}"]}
    result = client.request(model, samples, params={"max_new_tokens": N}, stream=False)
    assert result.collect()["tokens"].tolist() == ref["tokens"]
    assert result.text == ref["text"] and result.language == "fr"  # detected


def test_an_eos_ends_the_transcription(agent_client: tuple[Agent, AgentClient]) -> None:
    _, client = agent_client
    case, at = _eos_case()
    params = {"max_new_tokens": N, "language": case["language"], "task": case["task"]}
    samples = ARRAYS[f"audio_{case['clip']}"]
    reply, chunks = streamed(client, "whisper_eos", {"input_values": samples}, **params)
    assert tokens_of(chunks) == case["tokens"][: at + 1]
    assert reply.end.finish_reason == "eos"


def test_suppressed_tokens_are_never_chosen(agent_client: tuple[Agent, AgentClient]) -> None:
    """Samples drawn at a high temperature over the fixture's vocabulary of 395 would pick
    each of the suppressed tokens now and then; the config's `suppress_tokens` are never
    chosen, nor its `begin_suppress_tokens` first."""
    _, client = agent_client
    suppressed = set(REFERENCE["suppress_tokens"])
    first = set(REFERENCE["begin_suppress_tokens"])
    samples = ARRAYS["audio_chord"]
    seen: set[int] = set()
    for seed in range(12):
        params = {"max_new_tokens": 24, "temperature": 50.0, "seed": seed, "language": "en"}
        _, chunks = streamed(client, "whisper", {"input_values": samples}, **params)
        tokens = tokens_of(chunks)
        assert tokens[0] not in first
        seen.update(tokens)
    assert not seen & suppressed
    assert len(seen) > 100, "the temperature spreads the choices over the vocabulary"


def test_a_recording_longer_than_the_window_is_transcribed_window_after_window(
    agent_client: tuple[Agent, AgentClient],
) -> None:
    """A recording of 32.5 s: its first 30 s as a request of its own would be transcribed
    (Hugging Face's answer, the language detected), then the rest with the first window's
    text as its prompt and the first window's language, as a request sending them would
    be; one stream, its chunks numbered on, its `end` the last window's, its usage both's."""
    _, client = agent_client
    first = REFERENCE["cases"][1]  # the sweep, its language detected
    sweep, chord = ARRAYS["audio_sweep"], ARRAYS["audio_chord"]
    window = np.zeros(480000, np.float32)
    window[: sweep.size] = sweep
    recording = np.concatenate([window, chord])
    reply, chunks = streamed(client, "whisper", {"input_values": recording}, max_new_tokens=N)
    tokens = tokens_of(chunks)
    assert tokens[:N] == first["tokens"]
    language = language_of(first)
    first_text = "".join(c.text for c in chunks[:N])
    asked = {"max_new_tokens": N, "language": language}
    alone = {"input_values": chord, "prompt": first_text.strip()}
    second_reply, second = streamed(client, "whisper", alone, **asked)
    assert tokens[N:] == tokens_of(second) and len(tokens) == 2 * N
    assert [c.index for c in chunks] == list(range(2 * N))
    assert "".join(c.text for c in chunks) == first_text + "".join(c.text for c in second)
    assert reply.end.finish_reason == second_reply.end.finish_reason
    assert reply.end.language == language
    prompts = len(first["prompt"]) + second_reply.end.usage["prompt_tokens"]
    assert reply.end.usage == {"prompt_tokens": prompts, "completion_tokens": 2 * N}
    whole = client.request(
        "whisper", {"input_values": recording}, params={"max_new_tokens": N}, stream=False
    )
    assert whole.collect()["tokens"].tolist() == tokens
    assert whole.text == "".join(c.text for c in chunks)
    with pytest.raises(AgentError, match=r"params\.stop is not taken"):
        streamed(client, "whisper", {"input_values": recording}, stop=["x"])


@pytest.mark.parametrize(
    ("inputs", "params", "says"),
    [
        ({"input_values": np.zeros(0, np.float32)}, {}, "holds no samples"),
        ({"input_values": np.full(800, np.nan, np.float32)}, {}, "NaN or infinite"),
        ({"input_values": np.zeros((2, 800), np.float32)}, {}, "float samples [n] or [1, n]"),
        ({"input_values": np.zeros(800, np.int16)}, {}, "float samples [n] or [1, n]"),
        ({"input_features": np.zeros((1, 80, 100), np.float32)}, {}, "[1, 80, 3000]"),
        ({"prompt": "hello"}, {}, "takes inputs.input_values"),
        (
            {"input_values": np.zeros(800, np.float32), "prompt": "say <|en|>"},
            {},
            "holds a special token's text",
        ),
        (
            {"input_values": np.zeros(800, np.float32), "prompt": "x" * 4097},
            {},
            "4096 characters at most",
        ),
        ({"input_values": np.zeros(800, np.float32)}, {"language": "xx"}, "'xx' is not one"),
        ({"input_values": np.zeros(800, np.float32)}, {"task": "sing"}, "'sing' is not one"),
        ({"input_values": np.zeros(800, np.float32)}, {"language": 3}, "must be a text"),
    ],
)
def test_bad_recordings_and_prompts_are_refused(
    agent_client: tuple[Agent, AgentClient], inputs: dict[str, Any], params: Any, says: str
) -> None:
    _, client = agent_client
    with pytest.raises(AgentError) as e:
        streamed(client, "whisper", inputs, **params)
    assert e.value.code == "bad_request"
    assert says in str(e.value)
    _, chunks = streamed(client, "whisper", {"input_values": ARRAYS["audio_sweep"]})
    assert chunks, "the model still serves"


def test_the_prompt_rules_of_an_english_only_checkpoint() -> None:
    """No languages (a `*.en` checkpoint): the start and no-timestamps tokens alone, and a
    language asked is refused."""
    rules = SpeechPrompt(start=5, languages={}, tasks={}, forced=(), no_timestamps=9)
    assert rules.ids(None, None) == [5, 9]
    with pytest.raises(ValueError, match="knows no languages"):
        rules.ids("en", None)
    multilingual = SpeechPrompt(5, {"en": 6, "de": 7}, {"transcribe": 8, "translate": 4}, (), 9)
    assert multilingual.ids(None, None) == [5, None, 9]  # detected: no forced task
    assert multilingual.ids("<|DE|>", "translate") == [5, 7, 4, 9]


def test_members_of_one_run_step_in_lock_step() -> None:
    """Four recordings in one run: each encoder, detection and first step alone, then one
    run of the decoder a step for all, without `encoder_attention_mask` (every encoder
    output is the window's length); each member's tokens are Hugging Face's."""
    backend, options = OnnxRuntimeBackend(), BackendOptions(1)
    session = backend.load(FIXTURES / "model.onnx", options)
    setup = open_generation(None, session, FIXTURES, lambda f: backend.load(f, options))
    cases = REFERENCE["cases"][:4]
    assert setup.layout.cross is not None and setup.layout.cross.mask is None
    assert setup.batchable and not setup.layout.batchable
    asks = []
    for case in cases:
        params = {k: case[k] for k in ("language", "task") if case[k] is not None}
        inputs = {"input_values": ARRAYS[f"audio_{case['clip']}"]}
        asks.append(generate_mode.ask_of(inputs, {"max_new_tokens": N, **params}, setup))
    try:
        run, tokens = tokens_by_member(session, asks)
    finally:
        setup.close()
        session.close()
    assert tokens == {k: case["tokens"] for k, case in enumerate(cases)}
    detected = sum(case["language"] is None for case in cases)
    # the encoders, detections and first steps alone, then one run a step for all
    assert run.runs == 2 * len(cases) + detected + N - 1


def test_decoders_with_caches_of_different_lengths_do_not_join() -> None:
    """A Whisper's prompts differ in length where requests name different parts of it: an
    encoder-decoder's rows join only with caches of one length; a decoder's always do."""
    session = OnnxRuntimeBackend().load(FIXTURES / "model.onnx", BackendOptions(1))
    try:
        layout = recognise(session.inputs, session.outputs, GenerateConfig())
    finally:
        session.close()
    assert LockstepBatch.joins(layout, [4, 4]) and not LockstepBatch.joins(layout, [3, 4])
    decoder = dataclasses.replace(layout, cross=None)
    assert LockstepBatch.joins(decoder, [3, 4])


@pytest.mark.parametrize("case", [1, 7])
def test_the_detection_run_reads_the_prompts_start_once(
    case: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A detected language: the detection's run (the start token) is the prompt's first, and
    the next run reads the rest of the prompt after its cache; with a previous text before the
    start token, the prompt runs whole. The tokens are Hugging Face's either way."""
    backend, options = OnnxRuntimeBackend(), BackendOptions(1)
    session = backend.load(FIXTURES / "model.onnx", options)
    setup = open_generation(None, session, FIXTURES, lambda f: backend.load(f, options))
    ref = REFERENCE["cases"][case]
    assert ref["language"] is None
    shapes: list[tuple[int, ...]] = []
    real = session.run

    def spy(inputs: dict[str, Any]) -> Any:
        shapes.append(tuple(inputs["input_ids"].shape))
        return real(inputs)

    monkeypatch.setattr(session, "run", spy)
    inputs, params = request_of(ref)
    if "prompt" in inputs:  # as the wire gives a text: a string tensor
        inputs["prompt"] = np.array(inputs["prompt"], dtype=object)
    try:
        ask = generate_mode.ask_of(inputs, params, setup)
        _, tokens = tokens_by_member(session, [ask])
    finally:
        setup.close()
        session.close()
    assert tokens[0] == ref["tokens"]
    rest = len(ref["prompt"]) - 1  # after the start token
    if ref["text_prompt"] is None:
        assert shapes[:2] == [(1, 1), (1, rest)]
    else:
        assert shapes[:2] == [(1, 1), (1, len(ref["prompt"]))]
    assert len(shapes) == 1 + N


@pytest.mark.parametrize("beams", [1, 3])
def test_a_detected_transcription_on_a_device_session(
    beams: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU provider the caches stay where ONNX Runtime made them (IOBinding), the
    detection's too: greedy feeds them back bound; beams copy them to the host (they gather
    rows). The same paths, bound on the CPU here: Hugging Face's tokens either way."""
    import onnxruntime as ort

    from agent.models.backends.onnxruntime import OnnxSession
    from tests.generate_helpers import spy_on_bound_caches

    monkeypatch.setattr(OnnxSession, "keeps_on_device", property(lambda self: True))
    backend, options = OnnxRuntimeBackend(), BackendOptions(1)
    session = backend.load(FIXTURES / "model.onnx", options)
    setup = open_generation(None, session, FIXTURES, lambda f: backend.load(f, options))
    assert setup.device_cache
    fed = spy_on_bound_caches(monkeypatch)
    ref = REFERENCE["cases"][1]  # its language detected
    inputs, params = request_of(ref)
    try:
        ask = generate_mode.ask_of(inputs, {**params, "num_beams": beams}, setup)
        _, tokens = tokens_by_member(session, [ask])
    finally:
        setup.close()
        session.close()
    assert tokens[0] == (ref["tokens"] if beams == 1 else ref["beam"])
    if beams == 1:  # the detection's run, then every run fed the runtime's own values
        assert fed[0] == {np.ndarray} and all(kinds == {ort.OrtValue} for kinds in fed[1:])
