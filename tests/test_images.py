"""Encoded images in, decoded detections out: real Ultralytics YOLO exports (a YOLOv8 with
its raw head, a YOLO26 with its NMS-free one) and a torch classifier behind `[preprocess]` and
`[[postprocess]]`, asked with JPEG and PNG bytes.

Fixtures from `scripts/make_vision_models.py` and `scripts/make_yolo_end2end.py`: the
references are Ultralytics' own pipeline (LetterBox, the torch model, `non_max_suppression`,
`scale_boxes`) and `torch.topk`.
"""

from __future__ import annotations

import json
import queue
import resource
import shutil
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.client import AgentClient, AgentError
from agent.demo.broker import EmbeddedBroker
from agent.service.agent import Agent

cv2 = pytest.importorskip("cv2")

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "real"
YOLO = FIXTURES / "yolo"
YOLO26 = FIXTURES / "yolo26_end2end"
RTDETR = FIXTURES / "rtdetr"
POSE = FIXTURES / "yolo_pose"
SEG = FIXTURES / "yolo_seg"
OBB = FIXTURES / "yolo_obb"
CLASSIFIER = FIXTURES / "classifier"
META = json.loads((YOLO / "reference.json").read_text())
META26 = json.loads((YOLO26 / "reference.json").read_text())
META_RTDETR = json.loads((RTDETR / "reference.json").read_text())
META_POSE = json.loads((POSE / "reference.json").read_text())
META_SEG = json.loads((SEG / "reference.json").read_text())
META_OBB = json.loads((OBB / "reference.json").read_text())

LETTERBOX = """
[preprocess]
resize = [160, 160]
resize_mode = "letterbox"
pad_value = 114
scale = "1/255"
"""  # Ultralytics' own preprocessing at the fixtures' 160 x 160


def detect_config(meta: dict[str, Any], keys: str = "", preprocess: str = LETTERBOX) -> str:
    """A detector fixture's config.toml: `preprocess`, then `detect` on `output0` with `keys`
    (its layout) and the fixture's thresholds and labels."""
    limits = [k for k in ("score_threshold", "iou_threshold", "max_detections") if k in meta]
    lines = [f"{k} = {meta[k]}" for k in limits]
    return (
        f'{preprocess}\n[[postprocess]]\noutput = "output0"\nop = "detect"\n{keys}'
        + "\n".join(lines)
        + '\nlabels = "labels.txt"\n'
    )


YOLO_CONFIG = detect_config(META, 'format = "yolov8"\n')
YOLO26_CONFIG = detect_config(META26, 'format = "end2end"\n')
POSE_CONFIG = detect_config(META_POSE, f"keypoints = {META_POSE['keypoints']}\n")
SEG_CONFIG = detect_config(META_SEG, 'masks = "output1"\n')
OBB_CONFIG = detect_config(META_OBB, 'format = "obb"\n')
RTDETR_CONFIG = detect_config(
    META_RTDETR,
    'format = "end2end"\nbox_format = "xywh"\nnormalized = true\n',
    '\n[preprocess]\nresize = [160, 160]\nscale = "1/255"\n',  # RT-DETR stretches
)
CLASSIFIER_CONFIG = """
[preprocess]
resize = [32, 32]
scale = "1/255"

[[postprocess]]
output = "logits"
op = "softmax"

[[postprocess]]
output = "logits"
op = "topk"
k = 3
labels = "labels.txt"
"""
# limit_side with multiple_of on the same classifier graph would need dynamic input: the
# detector is fixed at 160, so limit_side is checked on geometry alone (test_postprocess).


def install(root: Path, name: str, source: Path, config: str) -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.toml").write_text(config)
    for file in ("model.onnx", "labels.txt"):
        shutil.copy(source / file, root / name / "1" / file)


@pytest.fixture(scope="module")
def vision_agent(
    broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Agent, AgentClient]]:
    from tests.conftest import agent_config, serve_agent

    tmp = tmp_path_factory.mktemp("vision")
    root = tmp / "models"
    install(root, "yolo", YOLO, YOLO_CONFIG)
    install(root, "yolo26", YOLO26, YOLO26_CONFIG)
    install(root, "rtdetr", RTDETR, RTDETR_CONFIG)
    install(root, "pose", POSE, POSE_CONFIG)
    install(root, "seg", SEG, SEG_CONFIG)
    install(root, "obb", OBB, OBB_CONFIG)
    install(root, "classifier", CLASSIFIER, CLASSIFIER_CONFIG)
    yield from serve_agent(broker, agent_config(tmp, broker, root))


def image_bytes(kind: str, folder: Path = YOLO) -> bytes:
    return (folder / ("image.jpg" if kind == "jpeg" else "image.png")).read_bytes()


@pytest.mark.parametrize("kind", ["jpeg", "png"])
@pytest.mark.parametrize(("model", "folder"), [("yolo", YOLO), ("yolo26", YOLO26)])
def test_detections_match_ultralytics(
    vision_agent: tuple[Agent, AgentClient], kind: str, model: str, folder: Path
) -> None:
    """The YOLOv8's raw head through the agent's NMS, and YOLO26's NMS-free one (its rows
    over the threshold, in the model's order), mapped back to the source image."""
    _, client = vision_agent
    reply = client.request(model, {"images": image_bytes(kind)}, stream=False)
    got = reply.collect()
    with np.load(folder / "reference.npz") as ref:
        boxes, scores = ref[f"{kind}.boxes"], ref[f"{kind}.scores"]
        classes = ref[f"{kind}.classes"]
    assert len(boxes) > 10  # enough boxes to say something
    assert got["boxes"].shape == boxes.shape and got["boxes"].dtype == np.float32
    np.testing.assert_array_equal(got["classes"], classes)
    np.testing.assert_allclose(got["scores"], scores, rtol=1e-4, atol=1e-5)
    # Ultralytics maps back with one gain and a rounded pad; the agent with the exact
    # resized size: the same pixels to within a fraction of one.
    np.testing.assert_allclose(got["boxes"], boxes, atol=1.0)
    labels = json.loads((folder / "reference.json").read_text())["labels"]
    assert list(got["labels"]) == [labels[c] for c in classes]
    assert reply.geometry == {
        "source": [240, 320],
        "input": [160, 160],
        "scale": [0.5, 0.5],
        "pad": [20, 0],
    }
    assert reply.timing is not None
    assert reply.timing["decode_ms"] > 0 and "preprocess_ms" in reply.timing


@pytest.mark.parametrize("kind", ["jpeg", "png"])
def test_rtdetr_detections_match_ultralytics(
    vision_agent: tuple[Agent, AgentClient], kind: str
) -> None:
    """RT-DETR's queries: centre boxes in fractions of the (stretched) input, no NMS; the
    predictor's own boxes, which it leaves unclipped, clipped to the image as the agent's
    boxes always are."""
    _, client = vision_agent
    reply = client.request("rtdetr", {"images": image_bytes(kind)}, stream=False)
    got = reply.collect()
    with np.load(RTDETR / "reference.npz") as ref:
        boxes, scores = ref[f"{kind}.boxes"], ref[f"{kind}.scores"]
        classes = ref[f"{kind}.classes"]
    assert len(boxes) > 10
    np.testing.assert_array_equal(got["classes"], classes)
    np.testing.assert_allclose(got["scores"], scores, rtol=1e-4, atol=1e-5)
    clipped = np.clip(boxes, 0, [320, 240, 320, 240])
    np.testing.assert_allclose(got["boxes"], clipped, atol=0.5)
    assert list(got["labels"]) == [META_RTDETR["labels"][c] for c in classes]
    assert reply.geometry is not None and reply.geometry["scale"] == [160 / 240, 0.5]


@pytest.mark.parametrize("kind", ["jpeg", "png"])
def test_pose_keypoints_match_ultralytics(
    vision_agent: tuple[Agent, AgentClient], kind: str
) -> None:
    """A pose model's keypoints ride with their boxes through NMS and come back in the
    photo's pixels, x, y and visibility, as Ultralytics' pipeline gives them."""
    _, client = vision_agent
    got = client.request("pose", {"images": image_bytes(kind)}, stream=False).collect()
    with np.load(POSE / "reference.npz") as ref:
        want = {name: ref[f"{kind}.{name}"] for name in ("boxes", "scores", "classes", "keypoints")}
    assert len(want["boxes"]) >= 5
    np.testing.assert_array_equal(got["classes"], want["classes"])
    np.testing.assert_allclose(got["scores"], want["scores"], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got["boxes"], want["boxes"], atol=1.0)  # as for the boxes above
    assert got["keypoints"].shape == want["keypoints"].shape == (len(want["boxes"]), 17, 3)
    np.testing.assert_allclose(got["keypoints"][..., :2], want["keypoints"][..., :2], atol=1.0)
    np.testing.assert_allclose(got["keypoints"][..., 2], want["keypoints"][..., 2], atol=1e-5)
    assert set(got["labels"]) == {"person"}


@pytest.mark.parametrize("kind", ["jpeg", "png"])
def test_segmentation_outlines_match_ultralytics(
    vision_agent: tuple[Agent, AgentClient], kind: str
) -> None:
    """A segmentation model's instances: boxes as Ultralytics', and each outline (the mask's
    largest contour, in the photo's pixels) covering what Ultralytics' covers: the bilinear
    upsampling of OpenCV and of torch may part at a mask's edge, so areas are compared."""
    _, client = vision_agent
    got = client.request("seg", {"images": image_bytes(kind)}, stream=False).collect()
    with np.load(SEG / "reference.npz") as ref:
        boxes, classes = ref[f"{kind}.boxes"], ref[f"{kind}.classes"]
        outlines = [ref[f"{kind}.{n}.outline"] for n in range(len(boxes))]
    assert "output1" not in got and len(boxes) >= 2
    np.testing.assert_array_equal(got["classes"], classes)
    np.testing.assert_allclose(got["boxes"], boxes, atol=1.0)
    assert len(got["segments"]) == len(outlines)
    for mine, theirs in zip(got["segments"], outlines, strict=True):
        assert mine.dtype == np.float32 and mine.shape[1] == 2 and len(theirs) >= 3
        assert overlap(mine, theirs, (240, 320)) > 0.9
    with pytest.raises(AgentError, match="needs output 'output1' too"):
        client.request(
            "seg", {"images": image_bytes(kind)}, params={"outputs": ["output0"]}
        ).collect()


@pytest.mark.parametrize("kind", ["jpeg", "png"])
def test_oriented_boxes_match_ultralytics(
    vision_agent: tuple[Agent, AgentClient], kind: str
) -> None:
    """An OBB model's boxes through Ultralytics' rotated Fast-NMS (probabilistic IoU), as
    `cx, cy, w, h, angle` in the photo's pixels, as its OBB predictor gives them."""
    _, client = vision_agent
    got = client.request("obb", {"images": image_bytes(kind)}, stream=False).collect()
    with np.load(OBB / "reference.npz") as ref:
        boxes, scores = ref[f"{kind}.boxes"], ref[f"{kind}.scores"]
        classes = ref[f"{kind}.classes"]
    assert len(boxes) >= 3 and got["boxes"].shape == boxes.shape == (len(boxes), 5)
    np.testing.assert_array_equal(got["classes"], classes)
    np.testing.assert_allclose(got["scores"], scores, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got["boxes"][:, :4], boxes[:, :4], atol=1.0)
    np.testing.assert_allclose(got["boxes"][:, 4], boxes[:, 4], atol=1e-4)
    assert list(got["labels"]) == [META_OBB["labels"][c] for c in classes]


def overlap(a: np.ndarray, b: np.ndarray, shape: tuple[int, int]) -> float:
    """Intersection over union of two outlines, filled on an image of `shape`."""
    canvases = []
    for outline in (a, b):
        canvas = np.zeros(shape, np.uint8)
        cv2.fillPoly(canvas, [np.rint(outline).astype(np.int32)], 1)
        canvases.append(canvas.astype(bool))
    return float((canvases[0] & canvases[1]).sum() / (canvases[0] | canvases[1]).sum())


def test_uint8_image_tensor_and_streamed_geometry(vision_agent: tuple[Agent, AgentClient]) -> None:
    """An H x W x 3 uint8 RGB image (as sources send frames) gives the PNG's detections;
    streamed chunks carry the geometry too."""
    _, client = vision_agent
    rgb = np.ascontiguousarray(cv2.imread(str(YOLO / "image.png"))[:, :, ::-1])
    chunks = list(client.request("yolo", {"images": rgb}))
    with np.load(YOLO / "reference.npz") as ref:
        np.testing.assert_array_equal(chunks[0].outputs["classes"], ref["png.classes"])
    assert chunks[0].geometry is not None and chunks[0].geometry["pad"] == [20, 0]


@pytest.mark.parametrize("kind", ["jpeg", "png"])
def test_topk_labels_match_torch(vision_agent: tuple[Agent, AgentClient], kind: str) -> None:
    _, client = vision_agent
    got = client.infer("classifier", {"image": image_bytes(kind, CLASSIFIER)}, stream=False)
    with np.load(CLASSIFIER / "reference.npz") as ref:
        values, indices = ref[f"{kind}.values"], ref[f"{kind}.indices"]
    np.testing.assert_array_equal(got["logits_indices"], indices)
    np.testing.assert_allclose(got["logits"], values, rtol=1e-4, atol=1e-6)
    labels = (CLASSIFIER / "labels.txt").read_text().split()
    assert got["logits_labels"].tolist() == [[labels[i] for i in indices[0]]]


def test_compressed_request_and_reply(vision_agent: tuple[Agent, AgentClient]) -> None:
    _, client = vision_agent
    plain = client.infer("classifier", {"image": image_bytes("png", CLASSIFIER)}, stream=False)
    packed = client.infer(
        "classifier",
        {"image": image_bytes("png", CLASSIFIER)},
        stream=False,
        compress=True,
        params={"reply_compression": "zstd"},
    )
    for name, value in plain.items():
        np.testing.assert_array_equal(packed[name], value)
    streamed = list(
        client.request(
            "yolo", {"images": image_bytes("jpeg")}, params={"reply_compression": "zstd"}
        )
    )
    with np.load(YOLO / "reference.npz") as ref:
        np.testing.assert_array_equal(streamed[0].outputs["classes"], ref["jpeg.classes"])
    with pytest.raises(AgentError) as refused:
        client.infer("classifier", {"image": image_bytes("png")}, params={"reply_compression": 1})
    assert refused.value.code == "bad_request"


def png_declaring(height: int, width: int) -> bytes:
    """A PNG whose IHDR declares `height` x `width` (a bomb: its data is a few bytes)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + data))
        return struct.pack(">I", len(data)) + kind + data + crc

    idat = zlib.compress(b"\x00" * 64)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def refusal(client: AgentClient, data: bytes) -> AgentError:
    with pytest.raises(AgentError) as refused:
        client.infer("yolo", {"images": data}, stream=False)
    return refused.value


def test_bad_images_are_refused_cleanly(vision_agent: tuple[Agent, AgentClient]) -> None:
    _, client = vision_agent
    jpeg = image_bytes("jpeg")
    client.infer("yolo", {"images": jpeg}, stream=False)  # warm: allocations settled
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    corrupt = refusal(client, b"not an image at all")
    assert corrupt.code == "bad_request" and "JPEG or a PNG" in corrupt.message
    bomb = refusal(client, png_declaring(50000, 50000))
    assert bomb.code == "too_large" and "max_image_pixels" in bomb.message
    truncated = refusal(client, jpeg[: len(jpeg) // 2])
    assert truncated.code == "bad_request" and "truncated JPEG" in truncated.message
    broken = bytearray(jpeg)
    broken[len(broken) // 2 : len(broken) // 2 + 2000] = b"\xff" * 2000  # scan data destroyed
    garbled = refusal(client, bytes(broken[:200]) + b"\xff\xd9")
    assert garbled.code == "bad_request"
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # A 50000 x 50000 decode would be 7.5 GB: the peak did not move (KiB; 16 MiB of noise).
    assert after - before < 16 * 1024
    assert client.infer("yolo", {"images": jpeg}, stream=False)["boxes"].shape[1] == 4


@pytest.mark.parametrize(
    ("model", "folder", "config"), [("yolo", YOLO, YOLO_CONFIG), ("seg", SEG, SEG_CONFIG)]
)
def test_a_folder_source_feeding_the_detector_publishes_boxes(
    broker: EmbeddedBroker, tmp_path: Path, model: str, folder: Path, config: str
) -> None:
    """A photo dropped in a folder: its detections on the source's stream, a segmentation
    model's outlines (an array an instance) among them."""
    from tests.conftest import agent_config

    root = tmp_path / "models"
    install(root, model, folder, config)
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    shutil.copy(YOLO / "image.png", inbox / "photo.png")
    toml = f'[[sources]]\nname = "door"\nkind = "folder"\nmodel = "{model}"\npath = "{inbox}"\n'
    settings = agent_config(tmp_path, broker, root, toml)
    got: queue.Queue[dict[str, Any]] = queue.Queue()
    client = AgentClient(broker.host, broker.port, device_id=settings.device_id).connect()
    client.listen(f"{settings.root_topic}/stream/door", lambda _t, m, _r: m and got.put(m))
    agent = Agent(settings)
    agent.start()
    try:
        message = got.get(timeout=30)
    finally:
        agent.stop()
        client.close()
    from agent.client import decode_outputs

    outputs = decode_outputs(message["outputs"])
    with np.load(folder / "reference.npz") as ref:
        np.testing.assert_array_equal(outputs["classes"], ref["png.classes"])
        np.testing.assert_allclose(outputs["boxes"], ref["png.boxes"], atol=1.0)
        if model == "seg":
            outlines = [ref[f"png.{n}.outline"] for n in range(len(ref["png.boxes"]))]
            assert [len(o) >= 3 for o in outputs["segments"]] == [True] * len(outlines)
            for mine, theirs in zip(outputs["segments"], outlines, strict=True):
                assert overlap(mine, theirs, (240, 320)) > 0.9
    assert message["geometry"]["source"] == [240, 320]
    assert message["file"] == "photo.png"
