"""A Hugging Face image processor's `preprocessor_config.json` as the version's `[preprocess]`.

An image model exported by optimum (`image-classification`: ViT, Swin, ConvNeXt...) comes
with its processor's config: how a photo becomes `pixel_values`. Where the model's
`config.toml` has no `[preprocess]` and the model takes one `pixel_values [batch, 3, H, W]`,
that config is read into one, so a request may send the JPEG or PNG as it is:

- `do_resize` with `size: {height, width}`: `resize = [height, width]`, stretched, with
  `resample` 0 nearest, 2 bilinear, 3 bicubic (PIL's numbers) as OpenCV's interpolation;
- `do_center_crop` with `size: {shortest_edge}` and `crop_size: {height, width}` (CLIP's):
  `resize_mode = "crop"`, the shorter side to `shortest_edge`, the centre kept;
- `size: {shortest_edge: N}` with `crop_pct` (ConvNeXt's): below 384, the shorter side to
  `int(N / crop_pct)` and the centre `N x N` kept; from 384, stretched to `N x N`;
- `do_rescale`, `rescale_factor`: `scale`; `do_normalize`, `image_mean`, `image_std`: `mean`,
  `std`; RGB, channels first, float32.

A processor this cannot express (a `shortest_edge` size without a crop, DeiT's square resize
before its crop, padding, another `resample`) gives none: the version loads and takes tensors, and
an info line says why. The resize is OpenCV's, not Pillow's: an image of the model's own size
goes in as the processor makes it; a resized one differs by Pillow's and OpenCV's rounding
(Pillow also smooths what it shrinks).

Imports only `backends.base`, `hf_files` and `preprocess`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from agent.models.backends.base import ModelLoadError, TensorSpec
from agent.models.hf_files import read_json
from agent.models.preprocess import PreprocessConfig

__all__ = ["PROCESSOR_FILE", "processor_preprocess"]

PROCESSOR_FILE = "preprocessor_config.json"
IMAGE_INPUT = "pixel_values"
_RESAMPLE = {0: "nearest", 2: "linear", 3: "cubic"}  # PIL.Image.Resampling's numbers
CROP_PCT_BELOW = 384  # ConvNeXt's processor crops below this size, stretches from it

log = logging.getLogger(__name__)


def processor_preprocess(specs: Sequence[TensorSpec], folder: Path) -> PreprocessConfig | None:
    """The `[preprocess]` that `folder`'s image processor describes for a model of inputs
    `specs`; None where it has none, or one the agent cannot express (logged)."""
    if len(specs) != 1 or specs[0].name != IMAGE_INPUT or len(specs[0].shape) != 4:
        return None
    processor = read_json(folder / PROCESSOR_FILE)
    if "image_processor_type" not in processor:
        return None
    problem = _unsupported(processor)
    if problem is not None:
        log.info("%s: its image processor is not applied on the box (%s)", folder, problem)
        return None
    try:
        return PreprocessConfig.model_validate(_keys(processor))
    except ValidationError as e:
        raise ModelLoadError(f"{PROCESSOR_FILE}: {e.errors()[0]['msg']}") from None


def _unsupported(processor: dict[str, Any]) -> str | None:
    size, crop = processor.get("size"), processor.get("crop_size")
    if processor.get("do_pad"):
        return "padding"
    if "crop_pct" in processor:
        if not _is_convnext(processor):
            return f"a crop_pct of {processor.get('image_processor_type')}"
        if not _is_shortest_edge(size):
            return f"crop_pct with size {size!r}: ConvNeXt's takes a shortest_edge"
    elif processor.get("do_center_crop"):
        if not (_is_shortest_edge(size) and _is_height_width(crop)):
            return f"size {size!r} and crop_size {crop!r}: a crop takes a shortest_edge"
    elif processor.get("do_resize", True) and not _is_height_width(size):
        return f"size {size!r}: only {{height, width}} is resized here"
    if processor.get("resample", 2) not in _RESAMPLE:
        return f"resample {processor.get('resample')!r}"
    return None


def _is_convnext(processor: dict[str, Any]) -> bool:
    kind = processor.get("image_processor_type")
    return isinstance(kind, str) and kind.startswith("ConvNextImageProcessor")


def _is_height_width(size: Any) -> bool:
    return isinstance(size, dict) and set(size) == {"height", "width"}


def _is_shortest_edge(size: Any) -> bool:
    return isinstance(size, dict) and set(size) == {"shortest_edge"}


def _keys(processor: dict[str, Any]) -> dict[str, Any]:
    keys: dict[str, Any] = {"input": IMAGE_INPUT, "color": "rgb", "layout": "NCHW"}
    if "crop_pct" in processor:  # ConvNeXt's: the shorter side to edge / crop_pct, then the
        edge = processor["size"]["shortest_edge"]  # centre edge x edge; from 384, stretched
        keys["resize"] = [edge, edge]
        if edge < CROP_PCT_BELOW:
            crop_pct = processor["crop_pct"]  # null: the processor's default, 224 / 256
            keys["resize_mode"] = "crop"
            keys["shortest_edge"] = int(edge / (crop_pct if crop_pct is not None else 224 / 256))
    elif processor.get("do_center_crop"):  # resized by the shorter side, then the centre
        crop = processor["crop_size"]
        keys["resize_mode"] = "crop"
        keys["resize"] = [crop["height"], crop["width"]]
        keys["shortest_edge"] = processor["size"]["shortest_edge"]
    elif processor.get("do_resize", True):
        size = processor["size"]
        keys["resize"] = [size["height"], size["width"]]
    if "resize" in keys:
        keys["interpolation"] = _RESAMPLE[processor.get("resample", 2)]
    if processor.get("do_rescale", True):
        keys["scale"] = float(processor.get("rescale_factor", 1 / 255))
    if processor.get("do_normalize", True):
        keys["mean"] = [float(v) for v in processor.get("image_mean", [0.5, 0.5, 0.5])]
        keys["std"] = [float(v) for v in processor.get("image_std", [0.5, 0.5, 0.5])]
    return keys
