"""A Hugging Face image processor's `preprocessor_config.json` as the version's `[preprocess]`.

An image model exported by optimum (`image-classification`: ViT, DeiT, BEiT, Swin...) comes
with its processor's config: how a photo becomes `pixel_values`. Where the model's
`config.toml` has no `[preprocess]` and the model takes one `pixel_values [batch, 3, H, W]`,
that config is read into one, so a request may send the JPEG or PNG as it is:

- `do_resize` with `size: {height, width}`: `resize = [height, width]`, stretched, with
  `resample` 0 nearest, 2 bilinear, 3 bicubic (PIL's numbers) as OpenCV's interpolation;
- `do_rescale`, `rescale_factor`: `scale`; `do_normalize`, `image_mean`, `image_std`: `mean`,
  `std`; RGB, channels first, float32.

A processor this cannot express (a `shortest_edge` size, a centre crop, padding, another
`resample`) gives none: the version loads and takes tensors, and an info line says why. The
resize is OpenCV's, not Pillow's: an image of the model's own size goes in as the processor
makes it; a resized one differs by Pillow's and OpenCV's rounding (Pillow also smooths what it
shrinks).

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
    size = processor.get("size")
    if processor.get("do_resize", True) and not (
        isinstance(size, dict) and set(size) == {"height", "width"}
    ):
        return f"size {size!r}: only {{height, width}} is resized here"
    if processor.get("do_center_crop") or processor.get("do_pad"):
        return "a centre crop or padding"
    if processor.get("resample", 2) not in _RESAMPLE:
        return f"resample {processor.get('resample')!r}"
    return None


def _keys(processor: dict[str, Any]) -> dict[str, Any]:
    keys: dict[str, Any] = {"input": IMAGE_INPUT, "color": "rgb", "layout": "NCHW"}
    if processor.get("do_resize", True):
        size = processor["size"]
        keys["resize"] = [size["height"], size["width"]]
        keys["interpolation"] = _RESAMPLE[processor.get("resample", 2)]
    if processor.get("do_rescale", True):
        keys["scale"] = float(processor.get("rescale_factor", 1 / 255))
    if processor.get("do_normalize", True):
        keys["mean"] = [float(v) for v in processor.get("image_mean", [0.5, 0.5, 0.5])]
        keys["std"] = [float(v) for v in processor.get("image_std", [0.5, 0.5, 0.5])]
    return keys
