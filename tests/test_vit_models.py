"""A Hugging Face image classifier exported by optimum (ViT, `image-classification`), served
with an empty `config.toml`: its `preprocessor_config.json` is its `[preprocess]`, its
`config.json`'s `id2label` its labels. The fixture (`tests/fixtures/real/vit`, from
`scripts/make_vit_models.py`) holds the logits of the `ViTImageProcessor` then the PyTorch
model, for each image opened with Pillow as a pipeline opens it."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.client import AgentClient
from agent.demo.broker import EmbeddedBroker
from agent.models.backends.base import TensorSpec
from agent.models.image_processor import processor_preprocess
from agent.service.agent import Agent

pytest.importorskip("cv2")

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "real" / "vit"
REFERENCE: dict[str, Any] = json.loads((FIXTURE / "reference.json").read_text(encoding="utf-8"))
TOP = '[[postprocess]]\noutput = "logits"\nop = "topk"\nk = 3\nlabels = "config.json"\n'


@pytest.fixture(scope="module")
def vit_agent(
    broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Agent, AgentClient]]:
    from tests.conftest import agent_config, serve_agent

    tmp = tmp_path_factory.mktemp("vit")
    root = tmp / "models"
    for name, config in {"vit": "", "vit_labels": TOP, "vit_crop": "", "vit_pct": ""}.items():
        ignore = shutil.ignore_patterns("*.png", "ref*", "crop*")
        shutil.copytree(FIXTURE, root / name / "1", ignore=ignore)
        (root / name / "config.toml").write_text(config)
    shutil.copy(FIXTURE / "crop" / "preprocessor_config.json", root / "vit_crop" / "1")
    shutil.copy(FIXTURE / "crop_pct" / "preprocessor_config.json", root / "vit_pct" / "1")
    yield from serve_agent(broker, agent_config(tmp, broker, root))


def test_an_image_of_the_models_size_is_prepared_as_the_processor_does(
    vit_agent: tuple[Agent, AgentClient],
) -> None:
    """No resize: RGB, rescaled by 1/255, normalised by 0.5 and 0.5, channels first, as
    `ViTImageProcessor` makes `pixel_values`; the logits are the PyTorch model's."""
    _, client = vit_agent
    png = (FIXTURE / "square.png").read_bytes()
    reply = client.request("vit", {"pixel_values": png}, stream=False)
    got = reply.collect()
    want = REFERENCE["images"]["square.png"]["logits"]
    np.testing.assert_allclose(got["logits"], [want], rtol=1e-4, atol=1e-5)
    assert reply.geometry is not None and reply.geometry["input"] == [32, 32]


def test_a_resized_image_comes_close_with_its_labels(vit_agent: tuple[Agent, AgentClient]) -> None:
    """48 x 64 resized to 32 x 32 by OpenCV, not Pillow: the logits near the pipeline's, the
    labels (config.json's id2label) in the pipeline's order."""
    _, client = vit_agent
    png = (FIXTURE / "wide.png").read_bytes()
    got = client.request("vit_labels", {"pixel_values": png}, stream=False).collect()
    want = np.array(REFERENCE["images"]["wide.png"]["logits"])
    order = np.argsort(-want)
    assert got["logits_labels"].tolist() == [[REFERENCE["labels"][i] for i in order]]
    np.testing.assert_allclose(got["logits"], [want[order]], atol=0.1)


@pytest.mark.parametrize(("image", "atol"), [("square.png", 1e-5), ("wide.png", 0.15)])
def test_a_clip_processor_resizes_the_shorter_side_and_crops(
    vit_agent: tuple[Agent, AgentClient], image: str, atol: float
) -> None:
    """`CLIPImageProcessor`: the shorter side to 32 (bicubic), the centre 32 x 32 kept
    (`resize_mode = "crop"`), CLIP's mean and std: the model's size goes in exactly, the
    48 x 64 image close (OpenCV's bicubic, not Pillow's); the crop's offset is the
    geometry's negative pad."""
    _, client = vit_agent
    png = (FIXTURE / image).read_bytes()
    reply = client.request("vit_crop", {"pixel_values": png}, stream=False)
    got = reply.collect()
    want = REFERENCE["images"][image]["crop_logits"]
    np.testing.assert_allclose(got["logits"], [want], rtol=1e-4, atol=atol)
    assert int(np.argmax(got["logits"])) == int(np.argmax(want))
    if image == "wide.png":  # 48 x 64 to 32 x 42, its columns 5..36 kept
        assert reply.geometry == {
            "source": [48, 64],
            "input": [32, 32],
            "scale": [32 / 48, 42 / 64],
            "pad": [0, -5],
        }


@pytest.mark.parametrize("image", ["square.png", "wide.png"])
def test_a_convnext_processor_crops_by_its_crop_pct(
    vit_agent: tuple[Agent, AgentClient], image: str
) -> None:
    """`ConvNextImageProcessor`, `shortest_edge` 32 and `crop_pct` 0.8: the shorter side to
    int(32 / 0.8) = 40, the centre 32 x 32 kept. Both images are resized (enlarged), so the
    logits come close to the pipeline's (OpenCV's bilinear, not Pillow's)."""
    _, client = vit_agent
    png = (FIXTURE / image).read_bytes()
    reply = client.request("vit_pct", {"pixel_values": png}, stream=False)
    got = reply.collect()
    want = REFERENCE["images"][image]["crop_pct_logits"]
    # Pixels a mean 0.002 (square) and 0.013 (wide) of a normalised unit from the pipeline's;
    # the random model makes that up to 0.24 of its logits.
    np.testing.assert_allclose(got["logits"], [want], atol=0.3)
    assert int(np.argmax(got["logits"])) == int(np.argmax(want))
    assert reply.geometry is not None and reply.geometry["input"] == [32, 32]


def processor_folder(tmp_path: Path, **processor: Any) -> Path:
    config = {"image_processor_type": "ViTImageProcessor", "size": {"height": 8, "width": 8}}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**config, **processor}))
    return tmp_path


IMAGE = [TensorSpec("pixel_values", np.dtype(np.float32), ("batch", 3, 8, 8))]


def test_what_the_processor_says_becomes_the_preprocess(tmp_path: Path) -> None:
    folder = processor_folder(
        tmp_path, resample=3, rescale_factor=0.5, image_mean=[0.1, 0.2, 0.3], image_std=[1, 2, 3]
    )
    pre = processor_preprocess(IMAGE, folder)
    assert pre is not None
    assert (pre.resize, pre.interpolation, pre.scale) == ([8, 8], "cubic", 0.5)
    assert (pre.mean, pre.std, pre.color, pre.layout) == ([0.1, 0.2, 0.3], [1, 2, 3], "rgb", "NCHW")


@pytest.mark.parametrize(
    ("processor", "inputs"),
    [
        ({"size": {"shortest_edge": 224}}, IMAGE),  # the shorter side, no crop: not expressed
        ({"size": {"shortest_edge": 8}, "crop_pct": 0.9}, IMAGE),  # not ConvNeXt's processor
        ({"do_center_crop": True}, IMAGE),
        ({"resample": 1}, IMAGE),  # Pillow's LANCZOS
        ({}, [TensorSpec("x", np.dtype(np.float32), ("batch", 3, 8, 8))]),
        ({}, [*IMAGE, TensorSpec("mask", np.dtype(np.int64), ("batch", 8, 8))]),
    ],
)
def test_what_is_not_applied(tmp_path: Path, processor: Any, inputs: Any) -> None:
    assert processor_preprocess(inputs, processor_folder(tmp_path, **processor)) is None


@pytest.mark.parametrize(
    ("edge", "crop_pct", "mode", "shortest"), [(8, None, "crop", 9), (384, 0.9, "stretch", None)]
)
def test_convnext_crop_pct_from_384_stretches(
    tmp_path: Path, edge: int, crop_pct: float | None, mode: str, shortest: int | None
) -> None:
    """Below 384 ConvNeXt's processor crops (a null crop_pct is its default, 224 / 256);
    from 384 it stretches to edge x edge."""
    folder = processor_folder(
        tmp_path,
        image_processor_type="ConvNextImageProcessor",
        size={"shortest_edge": edge},
        crop_pct=crop_pct,
    )
    pre = processor_preprocess(IMAGE, folder)
    assert pre is not None
    assert (pre.resize_mode, pre.resize, pre.shortest_edge) == (mode, [edge, edge], shortest)
