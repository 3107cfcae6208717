"""A keyword spotter exported by optimum (wav2vec2, `audio-classification`): raw samples in,
normalised as its feature extractor does; the best keywords out, named by its `config.json`'s
id2label (`softmax`, then `topk` with `labels = "config.json"`). The fixture
(`tests/fixtures/real/wav2vec2_classifier`, from `scripts/make_speech_models.py`) holds
Hugging Face's own answers for two seeded clips: the feature extractor's `input_values`, the
PyTorch model's logits and `pipeline("audio-classification")(clip, top_k=3)`."""

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
from agent.service.agent import Agent

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "real" / "wav2vec2_classifier"
REFERENCE: dict[str, Any] = json.loads((FIXTURE / "reference.json").read_text(encoding="utf-8"))
CLIPS = REFERENCE["clips"]  # "signal" (2 s) and "short" (0.5 s)
with np.load(FIXTURE / "reference.npz") as _arrays:
    ARRAYS: dict[str, np.ndarray[Any, Any]] = dict(_arrays)
ID2LABEL: dict[str, str] = json.loads((FIXTURE / "config.json").read_text())["id2label"]
LABELS = [ID2LABEL[str(i)] for i in range(len(ID2LABEL))]
TOP_K = (
    '[[postprocess]]\noutput = "logits"\nop = "softmax"\n'
    f'[[postprocess]]\noutput = "logits"\nop = "topk"\nk = {REFERENCE["top_k"]}\n'
    'labels = "config.json"\n'
)
# ONNX Runtime and PyTorch differ by 2e-5 in these logits (other kernels summing in another
# order), the far microphone's copy below by 3e-4 (its normalising, in float32, of samples a
# thousandth as loud): 1e-3 leaves room for another machine's kernels; scores, the softmax of
# the logits, differ by 2e-5 at most.
LOGITS = {"rtol": 1e-3, "atol": 1e-3}
SCORES = {"rtol": 0.0, "atol": 1e-4}
BATCH = '[stream]\nmode = "batch"\n' + TOP_K
MODELS = {"kws": TOP_K, "kws_logits": "", "kws_batch": BATCH, "kws_unnormalised": ""}


def clip(name: str) -> np.ndarray[Any, Any]:
    """A clip as recorded, as one row: `[1, samples]` float32."""
    return ARRAYS[name][None]


def far(samples: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The clip as a far microphone with a DC offset records it: a thousandth as loud, 0.01
    off zero. The model's group norm after its first convolution undoes most of a scale and
    an offset (the recording as captured is within 1e-3 of HF's logits even unnormalised), but
    not this: unnormalised its logits are 2 or more off and the labels change places."""
    result: np.ndarray[Any, Any] = (1e-3 * samples + 0.01).astype(np.float32)
    return result


@pytest.fixture(scope="module")
def kws_agent(
    broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Agent, AgentClient]]:
    from tests.conftest import agent_config, serve_agent

    tmp = tmp_path_factory.mktemp("kws")
    root = tmp / "models"
    for name, config in MODELS.items():
        shutil.copytree(FIXTURE, root / name / "1", ignore=shutil.ignore_patterns("ref*"))
        (root / name / "config.toml").write_text(config)
    extractor = root / "kws_unnormalised" / "1" / "preprocessor_config.json"
    settings = json.loads(extractor.read_text())
    extractor.write_text(json.dumps({**settings, "do_normalize": False}))
    yield from serve_agent(broker, agent_config(tmp, broker, root))


def test_every_version_is_ready_and_warmed_up(kws_agent: tuple[Agent, AgentClient]) -> None:
    """Warmed up on guessed samples: enough of them for the convolutions (4 are not)."""
    agent, _ = kws_agent
    models = agent.models.inventory()["models"]
    for name in MODELS:
        entry = models[name]["versions"]["1"]
        assert (entry["state"], entry["warmup"]) == ("ready", "ok"), (name, entry)


@pytest.mark.parametrize("name", sorted(CLIPS))
def test_samples_as_recorded_give_the_models_logits(
    kws_agent: tuple[Agent, AgentClient], name: str
) -> None:
    """The clip as captured gives the logits of Hugging Face's feature extractor and model; so
    do the extractor's own normalised samples (normalising is idempotent) and a far
    microphone's recording of it (normalised, it is the same clip)."""
    _, client = kws_agent
    expected = ARRAYS[f"{name}_logits"]
    for samples in (clip(name), ARRAYS[f"{name}_input_values"], far(clip(name))):
        got = client.request("kws_logits", {"input_values": samples}, stream=False).collect()
        assert got["logits"].shape == (1, len(LABELS))
        np.testing.assert_allclose(got["logits"], expected, **LOGITS)


def test_without_do_normalize_the_samples_go_in_as_sent(
    kws_agent: tuple[Agent, AgentClient],
) -> None:
    """The same model with `do_normalize: false`: the far recording is not the clip (what the
    test above would see if the agent did not normalise), HF's normalised samples still are."""
    _, client = kws_agent
    expected = ARRAYS["signal_logits"]
    sent = {"input_values": far(clip("signal"))}
    got = client.request("kws_unnormalised", sent, stream=False).collect()
    assert np.abs(got["logits"] - expected).max() > 1.0
    sent = {"input_values": ARRAYS["signal_input_values"]}
    got = client.request("kws_unnormalised", sent, stream=False).collect()
    np.testing.assert_allclose(got["logits"], expected, **LOGITS)


@pytest.mark.parametrize("name", sorted(CLIPS))
def test_the_best_keywords_are_the_pipelines(
    kws_agent: tuple[Agent, AgentClient], name: str
) -> None:
    """Labels from config.json's id2label, best first, with the pipeline's softmax scores."""
    _, client = kws_agent
    expected = CLIPS[name]
    got = client.request("kws", {"input_values": clip(name)}, stream=False).collect()
    assert got["logits_labels"].tolist() == [expected["labels"]]
    assert [[LABELS[i] for i in row] for row in got["logits_indices"].tolist()] == [
        expected["labels"]
    ]
    np.testing.assert_allclose(got["logits"], [expected["scores"]], **SCORES)


def test_the_two_clips_are_told_apart() -> None:
    """The fixture is worth testing against: the clips' best keywords differ, and neighbouring
    scores stand further apart than ONNX Runtime and PyTorch differ."""
    assert CLIPS["signal"]["labels"][0] != CLIPS["short"]["labels"][0]
    assert min(c["gap"] for c in CLIPS.values()) > 100 * SCORES["atol"]


def test_each_row_is_its_own_clip(kws_agent: tuple[Agent, AgentClient]) -> None:
    """Rows normalised one by one: the far microphone's copy of the recording and the feature
    extractor's samples answer as the recording does, in one run (whole) and a chunk a row
    (batch). A batch of clips of different lengths is not sent: wav2vec2 without an attention
    mask answers a zero-padded clip differently, in Hugging Face's pipeline too."""
    _, client = kws_agent
    signal = clip("signal")
    rows = np.concatenate([signal, far(signal), ARRAYS["signal_input_values"]])
    expected = CLIPS["signal"]
    got = client.request("kws", {"input_values": rows}, stream=False).collect()
    assert got["logits_labels"].tolist() == [expected["labels"]] * 3
    np.testing.assert_allclose(got["logits"], [expected["scores"]] * 3, **SCORES)
    chunks = list(client.request("kws_batch", {"input_values": rows}))
    assert [c.outputs["logits_labels"].tolist() for c in chunks] == [[expected["labels"]]] * 3


@pytest.mark.parametrize(
    ("samples", "says"),
    [
        (clip("short").astype(np.float64), r"'input_values' has dtype float64, expected float32"),
        ((clip("short") * 32767).astype(np.int16), r"'input_values' has dtype int16, expected"),
        (ARRAYS["short"], r"'input_values' has rank 1 \(shape \[8000\]\), expected rank 2"),
    ],
    ids=["float64", "int16 pcm", "one row without its batch axis"],
)
def test_bad_samples_are_refused_and_the_agent_keeps_serving(
    kws_agent: tuple[Agent, AgentClient], samples: np.ndarray[Any, Any], says: str
) -> None:
    _, client = kws_agent
    with pytest.raises(AgentError, match="bad_request") as refused:
        client.request("kws", {"input_values": samples}, stream=False).collect()
    assert refused.value.code == "bad_request"
    assert refused.match(says)
    got = client.request("kws", {"input_values": clip("short")}, stream=False).collect()
    assert got["logits_labels"].tolist() == [CLIPS["short"]["labels"]]
