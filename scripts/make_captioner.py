#!/usr/bin/env python3
"""Dev-only: regenerate ``tests/fixtures/real/trocr/`` (an image-to-text model for `generate`).

Not run by CI. Needs the export stack of ``scripts/make_real_models.py`` (torch,
transformers, optimum-onnx, tokenizers, pillow) in ``.venv-export``::

    .venv-export/bin/python scripts/make_captioner.py [--out tests/fixtures/real/trocr]

It writes one version folder as a user copies optimum's ``image-to-text-with-past`` export of a
seeded random ``VisionEncoderDecoderModel`` laid out as TrOCR is (a ViT encoder, a TrOCR
decoder with cross-attention; width 32, 2 + 2 layers, 4 heads, 32 x 32 images in 8 x 8
patches): ``encoder_model.onnx`` (``pixel_values [batch, 3, height, width]`` in,
``last_hidden_state`` out), ``model.onnx`` (optimum's merged decoder,
``decoder_model_merged.onnx`` renamed), and ``config.json``, ``generation_config.json``,
``preprocessor_config.json`` (``ViTImageProcessor``: the 32 x 32 size, rescale, normalise),
``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``. The tokenizer is
make_decoders' byte-level BPE with RoBERTa's special tokens first (``<s>`` 0, ``<pad>`` 1,
``</s>`` 2, ``<unk>`` 3) as TrOCR's; the decoder starts from ``</s>``, as TrOCR's does.

``images/``: the test images, seeded PNGs of the processor's own size (so the resize, Pillow's
in the processor and OpenCV's on the box, leaves them as they are). ``reference.json``: per
image, ``ViTImageProcessor``'s ``pixel_values`` (flattened), Hugging Face's greedy
``generate(do_sample=False, max_new_tokens=NEW_TOKENS)`` new tokens (the start token dropped),
the finish, the text (``decode(skip_special_tokens=True)``) and the smallest gap between the
best and second-best logit on that path; and ``generate(num_beams=3)``'s tokens.

Everything is seeded; the references are PyTorch's on its AVX2 kernels with two threads, and
the script runs itself again with ``PYTHONHASHSEED=0`` (optimum's merge names shared weights in
set order), so a rerun with the same pins writes the same bytes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from make_decoders import byte_level_bpe  # this script's folder
from make_real_models import _reexec_with_fixed_hash_seed  # optimum's merge: set order
from optimum_export import export_kept, pin_environment

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "tests" / "fixtures" / "real" / "trocr"
NEW_TOKENS = 16
SIZE = 32
SEED = 0
STD = 1.0  # the decoder's init_std and the encoder's initializer_range: 0.02 gives ties
THREADS = 2
SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]
IMAGES = ("stripes", "checker", "blobs", "gradient")
pin_environment()


def images() -> dict[str, Any]:
    """The seeded RGB test images, uint8 SIZE x SIZE x 3."""
    import numpy as np

    rng = np.random.default_rng(11)
    y, x = np.mgrid[0:SIZE, 0:SIZE]
    made = {
        "stripes": np.stack([(x // 4 % 2) * 255, y * 8, 255 - x * 8], axis=-1),
        "checker": np.stack([((x // 8 + y // 8) % 2) * 255] * 3, axis=-1),
        "blobs": rng.integers(0, 256, size=(SIZE, SIZE, 3)),
        "gradient": np.stack([x * 8, y * 8, (x + y) * 4], axis=-1),
    }
    return {name: np.clip(image, 0, 255).astype(np.uint8) for name, image in made.items()}


def build_tokenizer() -> Any:
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    tokenizer = byte_level_bpe(SPECIALS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>",
        special_tokens=[(t, tokenizer.token_to_id(t)) for t in ("<s>", "</s>")],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=64,
    )


def build(tokenizer: Any, seed: int) -> Any:
    import torch
    from transformers import (
        GenerationConfig,
        TrOCRConfig,
        VisionEncoderDecoderConfig,
        VisionEncoderDecoderModel,
        ViTConfig,
    )

    torch.manual_seed(seed)
    encoder = ViTConfig(
        image_size=SIZE,
        patch_size=8,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        initializer_range=STD,
    )
    decoder = TrOCRConfig(
        vocab_size=len(tokenizer),
        d_model=32,
        decoder_layers=2,
        decoder_attention_heads=4,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        init_std=STD,
        is_decoder=True,
        add_cross_attention=True,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.eos_token_id,
    )
    config = VisionEncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    config.decoder_start_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    config.eos_token_id = tokenizer.eos_token_id
    model = VisionEncoderDecoderModel(config).eval()
    model.generation_config = GenerationConfig(
        decoder_start_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return model


def processor() -> Any:
    from transformers import ViTImageProcessor

    return ViTImageProcessor(size={"height": SIZE, "width": SIZE})


def greedy(model: Any, pixels: Any) -> tuple[list[int], float]:
    import torch

    with torch.no_grad():
        out = model.generate(
            pixels,
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, 1:].tolist()
    gaps = [float(step[0].topk(2).values[0] - step[0].topk(2).values[1]) for step in out.logits]
    return tokens, min(gaps)


def beams(model: Any, pixels: Any) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(pixels, do_sample=False, max_new_tokens=NEW_TOKENS, num_beams=3)
    return [int(t) for t in out[0, 1:].tolist()]


def export(model: Any, tokenizer: Any, dst: Path) -> None:
    """`dst` made anew with the files of optimum's export of `model`."""

    def save(src: Path) -> None:
        model.save_pretrained(src)
        tokenizer.save_pretrained(src)
        processor().save_pretrained(src)

    export_kept(save, "image-to-text-with-past", dst)


def main() -> None:
    _reexec_with_fixed_hash_seed()
    import torch
    from PIL import Image
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args()
    out: Path = args.out
    seed: int = args.seed
    torch.set_num_threads(THREADS)
    model = build(build_tokenizer(), seed)
    export(model, build_tokenizer(), out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    eos = model.generation_config.eos_token_id
    (out / "images").mkdir()
    cases = []
    for name, array in images().items():
        Image.fromarray(array).save(out / "images" / f"{name}.png")
        image = Image.open(out / "images" / f"{name}.png")
        pixels = processor()(images=image, return_tensors="pt")["pixel_values"]
        tokens, gap = greedy(model, pixels)
        finish = "eos" if tokens[-1] == eos else "length"
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        beam = beams(model, pixels)
        cases.append(
            {
                "image": f"images/{name}.png",
                "pixel_values": [round(float(v), 6) for v in pixels.flatten()],
                "greedy": tokens,
                "finish": finish,
                "text": text,
                "gap": gap,
                "beam": beam,
            }
        )
        print(f"{name}: {tokens} {finish} (gap {gap:.4f}); beams {beam}")
    reference = {
        "seed": seed,
        "new_tokens": NEW_TOKENS,
        "vocab": len(tokenizer),
        "eos_token_id": eos,
        "decoder_start_token_id": model.generation_config.decoder_start_token_id,
        "gap": min(case["gap"] for case in cases),
        "cases": cases,
    }
    text = json.dumps(reference, indent=1, ensure_ascii=False)
    (out / "reference.json").write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
