#!/usr/bin/env python3
"""Dev-only: regenerate ``tests/fixtures/real/vit/`` (a Hugging Face image classifier).

Not run by CI. Needs the export stack of ``scripts/make_real_models.py`` (torch,
transformers, optimum-onnx, Pillow) in ``.venv-export``::

    .venv-export/bin/python scripts/make_vit_models.py [--out tests/fixtures/real/vit]

It writes a seeded random ``ViTForImageClassification`` (32 x 32 images, 8 x 8 patches, two
layers of width 32, three labels) exported with optimum's ``image-classification`` task
(``pixel_values [batch, 3, 32, 32]`` in, ``logits [batch, 3]`` out), with the files
``save_pretrained`` wrote (``config.json`` with ``id2label``, the ``ViTImageProcessor``'s
``preprocessor_config.json``: resize to 32 x 32, bilinear, rescale by 1/255, normalise by
0.5 and 0.5); two drawn PNG images, ``square.png`` (32 x 32, the model's size: no resize) and
``wide.png`` (48 x 64, resized); and ``reference.json``: the processor's
``pixel_values`` into the PyTorch model, for each image opened with Pillow as a pipeline
opens it, the logits. ``crop/preprocessor_config.json`` is a ``CLIPImageProcessor`` for the
same model (the shorter side to 32, bicubic, the centre 32 x 32 kept, CLIP's mean and std),
and ``crop_logits`` in ``reference.json`` what it and the model make of each image;
``crop_pct/preprocessor_config.json`` a ``ConvNextImageProcessor`` (the shorter side to
``int(32 / 0.8)`` = 40, the centre 32 x 32 kept) and ``crop_pct_logits`` the same for it.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from make_text_models import copy_export  # this script's folder

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "tests" / "fixtures" / "real" / "vit"
IMAGES = {"square.png": (32, 32), "wide.png": (48, 64)}
LABELS = ["cat", "dog", "robot"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def draw(path: Path, size: tuple[int, int], seed: int) -> None:
    """A smooth picture of `size` (h, w): colour gradients and a bright disc, seeded noise."""
    from PIL import Image

    height, width = size
    y, x = np.mgrid[0:height, 0:width] / max(height, width)
    rng = np.random.default_rng(seed)
    disc = ((x - 0.6) ** 2 + (y - 0.4) ** 2 < 0.05).astype(float)
    rgb = np.stack([x, y, 0.5 + 0.5 * disc], axis=2) * 200 + rng.integers(0, 40, (height, width, 3))
    Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8)).save(path)


def build() -> Any:
    import torch
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    config = ViTConfig(
        image_size=32,
        patch_size=8,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        initializer_range=0.3,
        id2label=dict(enumerate(LABELS)),
        label2id={label: i for i, label in enumerate(LABELS)},
    )
    return ViTForImageClassification(config).eval()


def main() -> None:
    import torch
    from optimum.exporters.onnx import main_export
    from PIL import Image
    from transformers import CLIPImageProcessor, ConvNextImageProcessor, ViTImageProcessor

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    out: Path = parser.parse_args().out
    model = build()
    processor = ViTImageProcessor(size={"height": 32, "width": 32})
    with tempfile.TemporaryDirectory(prefix="vit-") as tmp:
        src, onnx_dir = Path(tmp) / "hf", Path(tmp) / "onnx"
        model.save_pretrained(src)
        processor.save_pretrained(src)
        main_export(str(src), output=str(onnx_dir), task="image-classification", device="cpu")
        copy_export(onnx_dir, out)
    cropping = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size=32)
    cropping.save_pretrained(out / "crop")
    convnext = ConvNextImageProcessor(size={"shortest_edge": 32}, crop_pct=0.8)
    convnext.save_pretrained(out / "crop_pct")
    made_by = {"logits": processor, "crop_logits": cropping, "crop_pct_logits": convnext}
    images = {}
    for seed, (name, size) in enumerate(IMAGES.items()):
        draw(out / name, size, seed)
        image = Image.open(out / name).convert("RGB")
        images[name] = {"size": list(size)}
        for key, made in made_by.items():
            with torch.no_grad():
                logits = model(**made(image, return_tensors="pt")).logits[0].tolist()
            images[name][key] = logits
            print(f"vit {name} {key}: {logits}")
    reference = {"labels": LABELS, "images": images}
    (out / "reference.json").write_text(json.dumps(reference, indent=1) + "\n")


if __name__ == "__main__":
    main()
