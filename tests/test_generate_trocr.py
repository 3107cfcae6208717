"""`mode = "generate"` with an image-to-text model exported by optimum
(`image-to-text-with-past`: a `VisionEncoderDecoderModel` laid out as TrOCR, a ViT encoder and
a TrOCR decoder), as a user copies optimum's folder (`encoder_model.onnx` reading
`pixel_values`, the merged decoder as `model.onnx`, the configs, the image processor's
`preprocessor_config.json` and the tokenizer): the agent's pixel values equal
`ViTImageProcessor`'s, and its greedy and beam tokens, text and finish equal Hugging Face's
`generate`, for a PNG, an image array or the pixel values sent, one at a time and in
lock-step. The fixture and its references come from `scripts/make_captioner.py`."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.client import AgentClient, AgentError
from agent.demo.broker import EmbeddedBroker
from agent.models.backends.base import TensorSpec
from agent.models.image_processor import processor_preprocess
from agent.models.preprocess import load_cv2, preprocess_image
from agent.service.agent import Agent
from tests.generate_helpers import streamed, tokens_of
from tests.test_batching import batches_run

pytest.importorskip("tokenizers")
cv2 = pytest.importorskip("cv2")

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "real" / "trocr"
REFERENCE: dict[str, Any] = json.loads((FIXTURES / "reference.json").read_text(encoding="utf-8"))
CASES = REFERENCE["cases"]
N = int(REFERENCE["new_tokens"])
GENERATE = '[stream]\nmode = "generate"\n'
BATCHING = "[batching]\nmax_batch = 4\nmax_queue_delay_us = 300000\n"
MODELS = {"trocr": "", "trocr_batched": BATCHING, "trocr_no_processor": ""}


@pytest.fixture(scope="module")
def agent_client(
    broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Agent, AgentClient]]:
    from tests.conftest import agent_config, serve_agent

    tmp = tmp_path_factory.mktemp("trocr")
    root = tmp / "models"
    for name, extra in MODELS.items():
        ignore = shutil.ignore_patterns("reference.json", "images")
        shutil.copytree(FIXTURES, root / name / "1", ignore=ignore)
        (root / name / "config.toml").write_text(GENERATE + extra)
    (root / "trocr_no_processor" / "1" / "preprocessor_config.json").unlink()
    yield from serve_agent(broker, agent_config(tmp, broker, root), 20)


def png(case: dict[str, Any]) -> bytes:
    return (FIXTURES / case["image"]).read_bytes()


def test_the_pixel_values_equal_the_image_processors() -> None:
    spec = TensorSpec("pixel_values", np.dtype(np.float32), ("batch", 3, "height", "width"))
    image = processor_preprocess([spec], FIXTURES)
    assert image is not None and load_cv2() is not None
    for case in CASES:
        bgr = cv2.imread(str(FIXTURES / case["image"]), cv2.IMREAD_COLOR)
        pixels, _ = preprocess_image(bgr, image, bgr=True)
        want = np.array(case["pixel_values"], dtype=np.float32).reshape(pixels.shape)
        np.testing.assert_allclose(pixels, want, atol=1e-5, rtol=0)


def test_the_export_loads_and_one_without_its_processor_says_why(
    agent_client: tuple[Agent, AgentClient],
) -> None:
    agent, _ = agent_client
    models = agent.models.inventory()["models"]
    versions = {name: m["versions"]["1"] for name, m in models.items()}
    assert versions["trocr"]["state"] == "ready", versions["trocr"]
    assert versions["trocr"]["text_inputs"] == ["pixel_values"]
    assert versions["trocr_no_processor"]["state"] == "failed"
    assert (
        "needs the preprocessor_config.json of an image processor"
        in (versions["trocr_no_processor"]["error"])
    )


@pytest.mark.parametrize("case", range(len(CASES)))
def test_greedy_and_beam_tokens_equal_hugging_face(
    agent_client: tuple[Agent, AgentClient], case: int
) -> None:
    """The PNG as it is in: `generate`'s greedy tokens, text and finish; its beam search's."""
    _, client = agent_client
    ref = CASES[case]
    reply, chunks = streamed(client, "trocr", {"pixel_values": png(ref)}, max_new_tokens=N)
    assert tokens_of(chunks) == ref["greedy"]
    assert "".join(c.text for c in chunks) == ref["text"]
    assert reply.end.finish_reason == ref["finish"]
    assert reply.end.usage == {"prompt_tokens": 1, "completion_tokens": len(ref["greedy"])}
    _, beams = streamed(client, "trocr", {"pixel_values": png(ref)}, max_new_tokens=N, num_beams=3)
    assert tokens_of(beams) == ref["beam"]


def test_an_image_array_and_pixel_values_in_equal_the_png(
    agent_client: tuple[Agent, AgentClient],
) -> None:
    _, client = agent_client
    ref = CASES[1]
    rgb = cv2.imread(str(FIXTURES / ref["image"]), cv2.IMREAD_COLOR)[:, :, ::-1].copy()
    _, by_array = streamed(client, "trocr", {"pixel_values": rgb}, max_new_tokens=N)
    pixels = np.array(ref["pixel_values"], dtype=np.float32).reshape(1, 3, 32, 32)
    _, by_pixels = streamed(client, "trocr", {"pixel_values": pixels}, max_new_tokens=N)
    assert tokens_of(by_array) == tokens_of(by_pixels) == ref["greedy"]


def test_concurrent_requests_step_in_lock_step(agent_client: tuple[Agent, AgentClient]) -> None:
    """Under `[batching]` the four images' decoders share runs, unpadded (every encoder output
    has the image's length): each answer its own."""
    agent, client = agent_client
    got: dict[int, list[int]] = {}
    before = batches_run(agent, "trocr_batched")

    def ask(k: int) -> None:
        inputs = {"pixel_values": png(CASES[k])}
        got[k] = tokens_of(streamed(client, "trocr_batched", inputs, max_new_tokens=N)[1])

    threads = [threading.Thread(target=ask, args=(k,), name=f"ask-{k}") for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert got == {k: case["greedy"] for k, case in enumerate(CASES)}
    after = batches_run(agent, "trocr_batched")
    runs, requests = (a - b for a, b in zip(after, before, strict=True))
    assert requests == len(CASES) and runs < len(CASES)  # they shared runs


@pytest.mark.parametrize(
    ("inputs", "params", "says"),
    [
        ({"prompt": "hello"}, {}, "takes inputs.pixel_values"),
        ({"pixel_values": np.zeros((1, 3, 32), np.float32)}, {}, "must be a JPEG or PNG"),
        ({"pixel_values": np.full((1, 3, 32, 32), np.nan, np.float32)}, {}, "finite floats"),
        ({"pixel_values": np.zeros((1, 3, 7, 7), np.float32)}, {}, "[1, 3, 32, 32], the size"),
        ({"pixel_values": np.zeros((32, 32, 3), np.uint8)}, {"language": "en"}, "no params"),
    ],
)
def test_bad_pictures_are_refused(
    agent_client: tuple[Agent, AgentClient], inputs: dict[str, Any], params: Any, says: str
) -> None:
    _, client = agent_client
    with pytest.raises(AgentError) as e:
        streamed(client, "trocr", inputs, **params)
    assert e.value.code == "bad_request" and says in str(e.value)
