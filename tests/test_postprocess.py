"""Resize geometry, image headers and `[[postprocess]]` ops, checked without a broker."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from agent.models.backends.base import InferenceError, ModelLoadError
from agent.models.detect import nms
from agent.models.model_config import ModelConfigError, parse_model_config
from agent.models.postprocess import build_postprocess
from agent.models.preprocess import PreprocessConfig, preprocess_image
from agent.models.resize import Geometry, plan_resize
from agent.protocol.errors import Limits, WireError
from agent.protocol.images import encoded_image, read_image_header

YOLO = Path(__file__).resolve().parent / "fixtures" / "real" / "yolo"


def geometry(height: int, width: int, **options: object) -> dict[str, object]:
    config = PreprocessConfig.model_validate(options)
    frame = np.zeros((height, width, 3), dtype=np.uint8)
    image, geo = preprocess_image(frame, config)
    assert image.shape[2:] == tuple(geo.input)  # NCHW
    return geo.as_wire()


def test_letterbox_geometry_by_hand() -> None:
    # 720 x 1280 into 640 x 640: ratio 0.5, 360 x 640, 140 rows above and below.
    assert geometry(720, 1280, resize=[640, 640], resize_mode="letterbox") == {
        "source": [720, 1280],
        "input": [640, 640],
        "scale": [0.5, 0.5],
        "pad": [140, 0],
    }
    # 100 x 50 into 64 x 64: ratio 0.64, 64 x 32, 16 columns left (Ultralytics' rounding).
    assert geometry(100, 50, resize=[64, 64], resize_mode="letterbox")["pad"] == [0, 16]


def test_letterbox_pads_with_pad_value() -> None:
    config = PreprocessConfig(resize=[8, 8], resize_mode="letterbox", pad_value=114, dtype="uint8")
    image, geo = preprocess_image(np.full((4, 8, 3), 7, dtype=np.uint8), config)
    assert geo.pad == (2, 0)
    assert (image[0, :, :2] == 114).all() and (image[0, :, 6:] == 114).all()
    assert (image[0, :, 2:6] == 7).all()


def test_limit_side_geometry_by_hand() -> None:
    # PaddleOCR's max rule: 1280 x 736 -> longer side 960: 552 x 960, then multiples of 32.
    wire = geometry(736, 1280, resize_mode="limit_side", limit_side=960, multiple_of=32)
    assert wire["input"] == [544, 960]  # round(552 / 32) * 32 = 544
    assert wire["scale"] == [544 / 736, 960 / 1280]
    # Small images stay (max rule); the min rule scales the shorter side up to the limit.
    assert geometry(100, 200, resize_mode="limit_side", limit_side=960)["input"] == [100, 200]
    wire = geometry(100, 200, resize_mode="limit_side", limit_side=320, limit_type="min")
    assert wire["input"] == [320, 640] and wire["pad"] == [0, 0]


def test_fit_height_geometry_by_hand() -> None:
    """PaddleOCR's recogniser resize: 32 rows, the width ceil(32 * w / h), a canvas at least
    320 wide (int(32 * w / h) for a longer line, at most 3200), nothing padded above or left."""
    wire = geometry(26, 120, resize=[32, 320], resize_mode="fit_height")
    assert wire["input"] == [32, 320] and wire["pad"] == [0, 0]
    assert wire["scale"] == [32 / 26, 148 / 120]  # ceil(147.69) columns
    assert geometry(20, 421, resize=[32, 320], resize_mode="fit_height")["input"] == [32, 673]
    plan = plan_resize(20, 421, mode="fit_height", resize=(32, 320))
    assert (plan.width, plan.canvas) == (673, (32, 673))  # ceil(673.6) is cut to the canvas
    squeezed = plan_resize(10, 2000, mode="fit_height", resize=(32, 320))
    assert (squeezed.width, squeezed.canvas) == (3200, (32, 3200))
    rounded = plan_resize(26, 120, mode="fit_height", resize=(32, 300), multiple_of=32)
    assert (rounded.width, rounded.canvas) == (148, (32, 320))


@pytest.mark.parametrize("layout", ["NCHW", "HWC"])
def test_fit_height_pads_zeros_after_normalising(layout: str) -> None:
    options = {"scale": "1/255", "mean": [0.5], "std": [0.5], "layout": layout}
    config = PreprocessConfig.model_validate(
        {"resize": [4, 12], "resize_mode": "fit_height", **options}
    )
    image, geo = preprocess_image(np.full((4, 4, 3), 255, dtype=np.uint8), config)
    columns = image[0] if layout == "NCHW" else image.transpose(2, 0, 1)
    assert geo.input == (4, 12) and columns.shape == (3, 4, 12)
    assert (columns[:, :, :4] == 1.0).all() and (columns[:, :, 4:] == 0.0).all()


def test_crop_geometry_by_hand() -> None:
    """The shorter side to 32, the longer int(32 * long / short), the centre 32 x 32 kept
    (top = (H - 32) // 2, as transformers' center_crop): a negative pad, the crop's offset."""
    assert geometry(48, 64, resize=[32, 32], resize_mode="crop", shortest_edge=32) == {
        "source": [48, 64],
        "input": [32, 32],
        "scale": [32 / 48, 42 / 64],
        "pad": [0, -5],
    }
    tall = geometry(100, 50, resize=[20, 24], resize_mode="crop", shortest_edge=24)
    assert tall["input"] == [20, 24] and tall["pad"] == [-14, 0]  # 48 x 24, rows 14..33
    config = PreprocessConfig(resize=[2, 2], resize_mode="crop", shortest_edge=3, dtype="uint8")
    image, _ = preprocess_image(np.arange(9, dtype=np.uint8).reshape(3, 3, 1), config)
    assert image[0, 0].tolist() == [[0, 1], [3, 4]]  # (3 - 2) // 2 = 0: the top left kept


def test_multiple_of_rounds_stretch() -> None:
    assert plan_resize(50, 70, mode="stretch", resize=None, multiple_of=32).canvas == (64, 64)
    assert plan_resize(10, 10, mode="stretch", resize=None, multiple_of=32).canvas == (32, 32)


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        ({"resize_mode": "letterbox"}, "needs resize"),
        ({"resize_mode": "fit_height"}, "needs resize"),
        ({"resize_mode": "crop", "resize": [8, 8]}, "shortest_edge = N go together"),
        ({"resize_mode": "crop", "shortest_edge": 8}, "needs resize"),
        ({"resize_mode": "crop", "resize": [8, 9], "shortest_edge": 8}, "at least the crop"),
        ({"resize": [8, 8], "shortest_edge": 8}, "go together"),
        ({"resize_mode": "fit_height", "resize": [32, 320], "pad_value": 0}, "drop pad_value"),
        ({"resize_mode": "limit_side"}, "go together"),
        ({"limit_side": 32}, "go together"),
        ({"resize_mode": "limit_side", "limit_side": 32, "resize": [8, 8]}, "drop resize"),
    ],
)
def test_bad_resize_options(options: dict[str, object], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        PreprocessConfig.model_validate(options)


def test_image_headers() -> None:
    jpeg, png = (YOLO / "image.jpg").read_bytes(), (YOLO / "image.png").read_bytes()
    assert read_image_header(jpeg) == ("jpeg", 240, 320)
    assert read_image_header(png) == ("png", 240, 320)
    assert "truncated PNG" in str(read_image_header(png[:-20]))
    assert "truncated JPEG" in str(read_image_header(jpeg[:1000]))
    image = encoded_image(jpeg, Limits(), "x", "r1")
    assert image.header.height == 240 and image.dtype == np.uint8 and len(image) == len(jpeg)
    with pytest.raises(WireError) as refused:
        encoded_image(jpeg, Limits(max_image_pixels=320 * 240 - 1), "x", "r1")
    assert refused.value.code == "too_large" and refused.value.request_id == "r1"


def test_nms_is_greedy_and_class_aware() -> None:
    boxes = np.array([[0, 0, 10, 10], [1, 1, 11, 11], [20, 20, 30, 30]], dtype=np.float32)
    scores = np.array([0.9, 0.8, 0.7], dtype=np.float32)
    assert nms(boxes, scores, 0.5, 100).tolist() == [0, 2]
    assert nms(boxes, scores, 0.9, 100).tolist() == [0, 1, 2]
    assert nms(boxes, scores, 0.5, 1).tolist() == [0]


def test_detect_on_the_raw_output_matches_ultralytics(tmp_path: Path) -> None:
    meta = json.loads((YOLO / "reference.json").read_text())
    config = parse_model_config(
        f'[[postprocess]]\noutput = "output0"\nop = "detect"\n'
        f"score_threshold = {meta['score_threshold']}\niou_threshold = {meta['iou_threshold']}\n",
        "config.toml",
    )
    post = build_postprocess(config.postprocess, ["output0"], tmp_path)
    assert post is not None
    geo = Geometry((240, 320), (160, 160), (0.5, 0.5), (20, 0))
    with np.load(YOLO / "reference.npz") as ref:
        got = post.apply({"output0": ref["jpeg.raw"]}, geo)
        np.testing.assert_array_equal(got["classes"], ref["jpeg.classes"])
        np.testing.assert_allclose(got["boxes"], ref["jpeg.boxes"], atol=1e-3)
        np.testing.assert_allclose(got["scores"], ref["jpeg.scores"], rtol=1e-6)
    assert "output0" not in got and "labels" not in got


def test_yolov5_and_boxes_scores_layouts(tmp_path: Path) -> None:
    raw = np.zeros((1, 3, 5 + 2), dtype=np.float32)  # [1, N, 5 + C]
    raw[0, :, :4] = [[10, 10, 4, 4], [11, 10, 4, 4], [50, 50, 8, 8]]
    raw[0, :, 4] = [0.9, 0.9, 0.5]
    raw[0, :, 5:] = [[0.9, 0.1], [0.8, 0.1], [0.1, 0.9]]
    config = parse_model_config(
        '[[postprocess]]\noutput = "out"\nop = "detect"\nformat = "yolov5"\n', "c"
    )
    post = build_postprocess(config.postprocess, ["out"], tmp_path)
    assert post is not None
    got = post.apply({"out": raw})
    assert got["classes"].tolist() == [0, 1]
    np.testing.assert_allclose(got["scores"], [0.81, 0.45], rtol=1e-6)
    np.testing.assert_allclose(got["boxes"][1], [46, 46, 54, 54])
    pairs = parse_model_config(
        '[[postprocess]]\noutput = "b"\nop = "detect"\nformat = "boxes_scores"\nscores = "s"\n',
        "c",
    )
    post = build_postprocess(pairs.postprocess, ["b", "s"], tmp_path)
    assert post is not None
    got = post.apply({"b": np.array([[0, 0, 4, 4]], np.float32), "s": np.array([[0.1, 0.7]])})
    assert got["classes"].tolist() == [1] and set(got) == {"boxes", "scores", "classes"}


def test_end2end_rows_over_the_threshold_in_the_models_order(tmp_path: Path) -> None:
    """Final detections (x1, y1, x2, y2, score, class): no NMS (the two overlapping boxes
    both stay), the model's order kept, the first `max_detections`."""
    rows = np.array(
        [
            [
                [10, 10, 20, 20, 0.9, 2],
                [11, 10, 21, 20, 0.8, 2],
                [50, 50, 60, 60, 0.2, 0],
                [30, 30, 40, 40, 0.7, 1],
                [0, 0, 0, 0, 0.0, 0],
            ]
        ],
        np.float32,
    )
    config = parse_model_config(
        '[[postprocess]]\noutput = "out"\nop = "detect"\nformat = "end2end"\n'
        "score_threshold = 0.5\nmax_detections = 2\n",
        "c",
    )
    post = build_postprocess(config.postprocess, ["out"], tmp_path)
    assert post is not None
    got = post.apply({"out": rows})
    assert got["classes"].tolist() == [2, 2] and got["classes"].dtype == np.int64
    np.testing.assert_allclose(got["scores"], [0.9, 0.8])
    np.testing.assert_array_equal(got["boxes"], [[10, 10, 20, 20], [11, 10, 21, 20]])
    with pytest.raises(InferenceError, match="an end2end output has 6"):
        post.apply({"out": np.zeros((1, 5, 7), np.float32)})
    with pytest.raises(ModelConfigError, match='"end2end" takes no iou_threshold'):
        parse_model_config(
            '[[postprocess]]\noutput = "o"\nop = "detect"\nformat = "end2end"\n'
            "iou_threshold = 0.5\n",
            "c",
        )


def test_ctc_greedy_decoding_as_paddleocr(tmp_path: Path) -> None:
    """Best class a step; repeats merged unless a blank parts them; blanks dropped; the score
    the mean probability of the kept steps (0 for no text). Labels kept exactly (a space
    line is a character); `space` adds one after them; `blank` may be the last class."""
    (tmp_path / "keys.txt").write_text("a\nb\n \n")
    steps = [1, 1, 0, 1, 2, 2, 3, 0]  # a a _ a b b " " _   (0: the blank)
    probs = np.full((2, len(steps), 5), 0.01, np.float32)
    for t, c in enumerate(steps):
        probs[0, t, c] = 0.5 + t / 100
    probs[1, :, 0] = 0.9  # all blank
    config = parse_model_config(
        '[[postprocess]]\noutput = "y"\nop = "ctc"\nlabels = "keys.txt"\nspace = true\n', "c"
    )
    post = build_postprocess(config.postprocess, ["y"], tmp_path)
    assert post is not None
    got = post.apply({"y": probs})
    assert set(got) == {"y_text", "y_score"}
    assert got["y_text"].tolist() == ["aab ", ""]
    kept = [0.5, 0.53, 0.54, 0.56]
    np.testing.assert_allclose(got["y_score"], [np.float32(np.mean(kept)), 0.0], rtol=1e-6)
    with pytest.raises(InferenceError, match=r"has 4 classes; the labels .* make 5"):
        post.apply({"y": probs[:, :, :4]})
    last = parse_model_config(
        '[[postprocess]]\noutput = "y"\nop = "ctc"\nlabels = "keys.txt"\nblank = 3\n', "c"
    )
    post = build_postprocess(last.postprocess, ["y"], tmp_path)
    assert post is not None
    blank_last = probs[:, :, [1, 2, 3, 0]]  # a, b, " ", then the blank
    assert post.apply({"y": blank_last})["y_text"].tolist() == ["aab ", ""]
    past = parse_model_config(
        '[[postprocess]]\noutput = "y"\nop = "ctc"\nlabels = "keys.txt"\nblank = 9\n', "c"
    )
    with pytest.raises(ModelLoadError, match="blank 9 is past the 4 classes"):
        build_postprocess(past.postprocess, ["y"], tmp_path)
    with pytest.raises(ModelConfigError, match='"ctc" needs labels'):
        parse_model_config('[[postprocess]]\noutput = "y"\nop = "ctc"\n', "c")


def test_db_text_boxes_by_hand(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One bar of text in a 64 x 96 map: its rectangle (20..69, 10..29 at pixel centres)
    grown by area * 1.5 / perimeter (10.3 pixels), corners clockwise from the top left,
    clipped to the map; its score the map's mean inside. Only one image's map is taken; the
    op needs OpenCV, said at load."""
    probability = np.zeros((1, 1, 64, 96), np.float32)
    probability[0, 0, 10:30, 20:70] = 0.9
    config = parse_model_config('[[postprocess]]\noutput = "maps"\nop = "db"\n', "c")
    post = build_postprocess(config.postprocess, ["maps"], tmp_path)
    assert post is not None
    got = post.apply({"maps": probability})
    assert got["boxes"].tolist() == [[[10, 0], [79, 0], [79, 39], [10, 39]]]
    np.testing.assert_allclose(got["scores"], [0.9], rtol=1e-6)
    assert set(got) == {"boxes", "scores"}
    assert post.apply({"maps": np.zeros((1, 1, 64, 96), np.float32)})["boxes"].shape == (0, 4, 2)
    with pytest.raises(InferenceError, match="one image's map"):
        post.apply({"maps": np.zeros((2, 1, 64, 96), np.float32)})
    monkeypatch.setattr("agent.models.postprocess.load_cv2", lambda: None)
    with pytest.raises(ModelLoadError, match='"db" needs OpenCV'):
        build_postprocess(config.postprocess, ["maps"], tmp_path)


@pytest.mark.parametrize(
    "keys",
    ['format = "yolov5"\nkeypoints = [17, 3]', "keypoints = [17]", "keypoints = [17, 4]"],
)
def test_keypoints_are_a_yolov8_pose_shape(keys: str) -> None:
    with pytest.raises(ModelConfigError, match=r"keypoints = \[K, D\]"):
        parse_model_config(f'[[postprocess]]\noutput = "o"\nop = "detect"\n{keys}\n', "c")


def test_obb_boxes_have_their_own_form() -> None:
    for keys in ('box_format = "xyxy"', "normalized = true"):
        with pytest.raises(ModelConfigError, match='"obb" takes no box_format or normalized'):
            parse_model_config(
                f'[[postprocess]]\noutput = "o"\nop = "detect"\nformat = "obb"\n{keys}\n', "c"
            )


def test_rotated_fast_nms_by_hand() -> None:
    """Two long boxes crossing at right angles overlap little as Gaussians and both stay; a
    copy turned a little overlaps the first a lot and goes. Fast-NMS drops a box wherever a
    better one overlaps it, whether or not that one stays: in a chain of three, the third
    goes for the second, which goes too (greedy NMS would keep the third)."""
    from agent.models.rotated import fast_nms, probiou

    boxes = np.array(
        [
            [50, 50, 80, 10, 0.0],
            [50, 50, 80, 10, 0.05],
            [50, 50, 80, 10, np.pi / 2],
        ],
        np.float32,
    )
    # Ultralytics' batch_probiou of the same boxes (8.4.190): 0.86282, 0.13176, 0.13192
    np.testing.assert_allclose(probiou(boxes)[0, 1:], [0.86282, 0.13176], atol=1e-4)
    assert fast_nms(boxes, np.array([0.9, 0.8, 0.7], np.float32), 0.5).tolist() == [0, 2]
    chain = np.array([[0, 0, 20, 20, 0], [8, 0, 20, 20, 0], [16, 0, 20, 20, 0]], np.float32)
    # batch_probiou: 0.53808 between neighbours, 0.21444 end to end
    np.testing.assert_allclose(probiou(chain)[0, 1:], [0.53808, 0.21444], atol=1e-4)
    assert fast_nms(chain, np.array([0.9, 0.8, 0.7], np.float32), 0.5).tolist() == [0]


def test_masks_are_a_yolov8_segmentation_output(tmp_path: Path) -> None:
    for keys in ('format = "yolov5"\nmasks = "p"', 'masks = "p"\nkeypoints = [17, 3]'):
        with pytest.raises(ModelConfigError, match="masks = NAME"):
            parse_model_config(f'[[postprocess]]\noutput = "o"\nop = "detect"\n{keys}\n', "c")
    config = parse_model_config('[[postprocess]]\noutput = "o"\nop = "detect"\nmasks = "p"\n', "c")
    with pytest.raises(ModelLoadError, match="no output 'p'"):
        build_postprocess(config.postprocess, ["o"], tmp_path)


def test_elementwise_ops(tmp_path: Path) -> None:
    (tmp_path / "labels.txt").write_text("a\nb\nc\n")
    config = parse_model_config(
        '[[postprocess]]\noutput = "x"\nop = "sigmoid"\n'
        '[[postprocess]]\noutput = "x"\nop = "threshold"\nvalue = 0.5\n'
        '[[postprocess]]\noutput = "y"\nop = "topk"\nk = 2\nlabels = "labels.txt"\n'
        '[[postprocess]]\noutput = "z"\nop = "argmax"\n'
        '[[postprocess]]\noutput = "w"\nop = "cast"\ndtype = "float16"\n'
        '[[postprocess]]\noutput = "v"\nop = "drop"\n',
        "c",
    )
    post = build_postprocess(config.postprocess, ["x", "y", "z", "w", "v"], tmp_path)
    assert post is not None
    got = post.apply(
        {
            "x": np.array([-3.0, 0.0, 3.0], np.float32),
            "y": np.array([[0.1, 0.7, 0.2]], np.float32),
            "z": np.array([[1, 5, 2]]),
            "w": np.ones(2),
            "v": np.ones(1),
        }
    )
    assert got["x"].tolist() == [0, 0, 1] and got["x"].dtype == np.uint8
    assert got["y"].tolist() == [[np.float32(0.7), np.float32(0.2)]]
    assert got["y_indices"].tolist() == [[1, 2]] and got["y_labels"].tolist() == [["b", "c"]]
    assert got["z"].tolist() == [1] and got["w"].dtype == np.float16 and "v" not in got
    assert post.apply({"w": np.ones(1)}).keys() == {"w"}  # ops on absent outputs: skipped


def test_bad_postprocess_configs(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match="takes no k"):
        parse_model_config('[[postprocess]]\noutput = "x"\nop = "softmax"\nk = 2\n', "c")
    with pytest.raises(ModelConfigError, match=r"postprocess\.0\.op"):
        parse_model_config('[[postprocess]]\noutput = "x"\nop = "nms"\n', "c")
    config = parse_model_config('[[postprocess]]\noutput = "nope"\nop = "softmax"\n', "c")
    with pytest.raises(ModelLoadError, match="no output 'nope'"):
        build_postprocess(config.postprocess, ["logits"], tmp_path)
    config = parse_model_config(
        '[[postprocess]]\noutput = "x"\nop = "topk"\nlabels = "missing.txt"\n', "c"
    )
    with pytest.raises(ModelLoadError, match="cannot read labels"):
        build_postprocess(config.postprocess, ["x"], tmp_path)
