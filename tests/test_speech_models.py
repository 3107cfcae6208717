"""A CTC speech recogniser exported by optimum (wav2vec2, `automatic-speech-recognition`): raw
samples in, normalised as its feature extractor does; text out, decoded as its tokenizer
decodes (`ctc` with `labels = "vocab.json"`). The fixture (`tests/fixtures/real/wav2vec2`, from
`scripts/make_speech_models.py`) holds Hugging Face's own pipeline output for a seeded
signal: the processor's `input_values`, the PyTorch model's logits, `batch_decode`'s text."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.client import AgentClient, AgentError
from agent.demo.broker import EmbeddedBroker
from agent.models.backends.base import ModelLoadError
from agent.models.postprocess import PostprocessOp, build_postprocess
from agent.service.agent import Agent

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "real" / "wav2vec2"
REFERENCE: dict[str, Any] = json.loads((FIXTURE / "reference.json").read_text(encoding="utf-8"))
SIGNAL = np.load(FIXTURE / "signal.npy")[None]  # [1, samples] float32, as recorded
CTC = '[[postprocess]]\noutput = "logits"\nop = "ctc"\nlabels = "vocab.json"\n'
LOGITS = {"rtol": 1e-3, "atol": 1e-3}  # ONNX Runtime and PyTorch differ by about 1e-4 here


@pytest.fixture(scope="module")
def speech_agent(
    broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Agent, AgentClient]]:
    from tests.conftest import agent_config, serve_agent

    tmp = tmp_path_factory.mktemp("speech")
    root = tmp / "models"
    models = {"asr": CTC, "asr_logits": "", "asr_batch": '[stream]\nmode = "batch"\n' + CTC}
    for name, config in models.items():
        shutil.copytree(FIXTURE, root / name / "1", ignore=shutil.ignore_patterns("ref*", "sig*"))
        (root / name / "config.toml").write_text(config)
    yield from serve_agent(broker, agent_config(tmp, broker, root))


def test_samples_are_normalised_as_the_feature_extractor_does(
    speech_agent: tuple[Agent, AgentClient],
) -> None:
    """The recording as captured gives the logits of Hugging Face's processor and model."""
    _, client = speech_agent
    got = client.request("asr_logits", {"input_values": SIGNAL}, stream=False).collect()
    with np.load(FIXTURE / "reference.npz") as reference:
        assert got["logits"].shape == (1, REFERENCE["frames"], 32)
        np.testing.assert_allclose(got["logits"], reference["logits"], **LOGITS)


def test_the_text_is_the_tokenizers_decode(speech_agent: tuple[Agent, AgentClient]) -> None:
    """Best class a frame, repeats merged, the pad token (the blank) dropped, `|` a space,
    special tokens kept as the tokenizer keeps them, stripped: `batch_decode`'s text."""
    _, client = speech_agent
    got = client.request("asr", {"input_values": SIGNAL}, stream=False).collect()
    assert got["logits_text"].tolist() == [REFERENCE["text"]]
    assert " " in REFERENCE["text"] and "</s>" in REFERENCE["text"]


def test_each_row_is_its_own_utterance(speech_agent: tuple[Agent, AgentClient]) -> None:
    """Normalised row by row: a quieter, offset copy of the recording and the processor's own
    normalised samples (normalising is idempotent) read as the recording does."""
    _, client = speech_agent
    with np.load(FIXTURE / "reference.npz") as reference:
        normalised = reference["input_values"]
    rows = np.concatenate([SIGNAL, 0.25 * SIGNAL + 0.1, normalised]).astype(np.float32)
    got = client.request("asr", {"input_values": rows}, stream=False).collect()
    assert got["logits_text"].tolist() == [REFERENCE["text"]] * 3
    chunks = list(client.request("asr_batch", {"input_values": rows}))
    assert [c.outputs["logits_text"].tolist() for c in chunks] == [[REFERENCE["text"]]] * 3


def test_samples_of_another_type_are_refused(speech_agent: tuple[Agent, AgentClient]) -> None:
    _, client = speech_agent
    with pytest.raises(AgentError, match=r"bad_request.*input_values.*float32"):
        client.request("asr", {"input_values": SIGNAL.astype(np.float64)}).collect()


def vocab_folder(tmp_path: Path, vocab: dict[str, int], **config: Any) -> Path:
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def decode(folder: Path, best: list[int], classes: int) -> str:
    op = PostprocessOp(output="logits", op="ctc", labels="vocab.json")
    post = build_postprocess([op], ["logits"], folder)
    assert post is not None
    logits = np.eye(classes, dtype=np.float32)[best][None]
    return str(post.apply({"logits": logits})["logits_text"][0])


def test_the_tokenizers_options(tmp_path: Path) -> None:
    """Another pad token (the blank) and delimiter, lower-casing and transformers' clean-up
    of spaces before punctuation, as `tokenizer_config.json` sets them."""
    vocab = {"A": 0, "[PAD]": 1, "_": 2, ".": 3, "B": 4}
    folder = vocab_folder(
        tmp_path,
        vocab,
        pad_token="[PAD]",
        word_delimiter_token="_",
        do_lower_case=True,
        clean_up_tokenization_spaces=True,
    )
    assert decode(folder, [2, 0, 1, 0, 0, 2, 3, 2, 4, 4, 2], 5) == "aa. b"


@pytest.mark.parametrize(
    ("vocab", "says"),
    [
        ({"<pad>": 0, "a": 2}, "ids 0 to n-1"),
        ({"a": 0, "b": 1}, r"the pad token '<pad>' \(the blank\) is not in vocab\.json"),
    ],
)
def test_a_vocabulary_that_cannot_decode(tmp_path: Path, vocab: dict[str, int], says: str) -> None:
    with pytest.raises(ModelLoadError, match=says):
        decode(vocab_folder(tmp_path, vocab), [0], 2)


def test_the_blank_comes_from_the_tokenizer() -> None:
    with pytest.raises(ValueError, match="drop space and blank"):
        PostprocessOp(output="logits", op="ctc", labels="vocab.json", blank=3)


WAV2VEC2 = {"feature_extractor_type": "Wav2Vec2FeatureExtractor", "do_normalize": True}


@pytest.mark.parametrize(
    ("changed", "mode", "rank", "normalises"),
    [
        ({}, "whole", 2, True),
        ({}, "batch", 2, True),
        ({}, "scan", 2, True),
        ({}, "steps", 2, False),
        ({"do_normalize": False}, "whole", 2, False),
        ({"feature_extractor_type": "WhisperFeatureExtractor"}, "whole", 2, False),
        ({}, "whole", 3, False),
    ],
)
def test_which_versions_normalise(
    tmp_path: Path, changed: dict[str, Any], mode: str, rank: int, normalises: bool
) -> None:
    """Whole utterances (whole and batch modes) of a normalising wav2vec2-style extractor, and
    a scan's windows (each on its own: tests/test_speech_windows.py); not a steps loop."""
    from agent.models.audio_inputs import open_audio_normalization
    from agent.models.backends.base import TensorSpec

    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**WAV2VEC2, **changed}))
    specs = [TensorSpec("input_values", np.dtype(np.float32), ("batch", "samples", 1)[:rank])]
    scanned = "input_values" if mode == "scan" else None
    found = open_audio_normalization(specs, tmp_path, mode, scanned)
    assert (found is not None) is normalises
    assert found is None or found.per_window is (mode == "scan")
