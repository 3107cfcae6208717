#!/usr/bin/env python3
"""Dev-only: regenerate ``tests/fixtures/real/wav2vec2/`` (a CTC speech recogniser).

Not run by CI. Needs the export stack of ``scripts/make_real_models.py`` (torch,
transformers, optimum-onnx) in ``.venv-export``::

    .venv-export/bin/python scripts/make_speech_models.py [--out tests/fixtures/real/wav2vec2]

It writes a seeded random ``Wav2Vec2ForCTC`` (a small one: three convolutions down to a frame
every 80 samples, two transformer layers of width 32) exported with optimum's
``automatic-speech-recognition`` task (``input_values [batch, samples]`` in, ``logits
[batch, frames, 32]`` out), with the files ``save_pretrained`` wrote for its processor: the
character ``vocab.json`` of a ``Wav2Vec2CTCTokenizer`` (``<pad>`` the CTC blank, ``|`` the
word delimiter), ``tokenizer_config.json``, ``special_tokens_map.json`` and the feature
extractor's ``preprocessor_config.json`` (``do_normalize``: zero mean, unit variance). Beside
them, ``signal.npy`` (two seconds at 16 kHz: tone bursts and noise, seeded, float32) and
``reference.json``: what Hugging Face's own pipeline makes of it, the processor's normalised
``input_values`` into the PyTorch model, the arg max of each frame decoded by
``processor.batch_decode``; the logits in ``reference.npz``.
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
DEFAULT_OUT = REPO_ROOT / "tests" / "fixtures" / "real" / "wav2vec2"
RATE = 16000
CHARACTERS = "abcdefghijklmnopqrstuvwxyz'"
# A seed whose frames keep their best class clear of the second (0.011 at least, where ONNX
# Runtime and PyTorch differ by 1e-4) and have blanks among them (15 %).
SEED = 2
# The word delimiter's class: one that model picks often, so that the text has words. (A
# random model's best classes are few; with `|` after the specials it never picked it.)
DELIMITER_ID = 16

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def signal() -> np.ndarray[Any, Any]:
    """Two seconds: noise, three tone bursts of different pitch and loudness, a quiet gap."""
    rng = np.random.default_rng(7)
    t = np.arange(2 * RATE) / RATE
    x = 0.02 * rng.standard_normal(t.size)
    for start, pitch, loud in ((0.2, 220.0, 0.5), (0.8, 660.0, 0.3), (1.3, 1200.0, 0.6)):
        burst = (t >= start) & (t < start + 0.35)
        x[burst] += loud * np.sin(2 * np.pi * pitch * t[burst])
    return x.astype(np.float32)


def processor(folder: Path) -> Any:
    """A Wav2Vec2Processor with a character vocabulary, saved into `folder`."""
    from transformers import Wav2Vec2CTCTokenizer, Wav2Vec2FeatureExtractor, Wav2Vec2Processor

    tokens = ["<pad>", "<s>", "</s>", "<unk>", *CHARACTERS]
    tokens.insert(DELIMITER_ID, "|")
    vocab = {token: i for i, token in enumerate(tokens)}
    (folder / "vocab.json").write_text(json.dumps(vocab))
    tokenizer = Wav2Vec2CTCTokenizer(str(folder / "vocab.json"))
    extractor = Wav2Vec2FeatureExtractor(
        feature_size=1, sampling_rate=RATE, padding_value=0.0, do_normalize=True
    )
    result = Wav2Vec2Processor(feature_extractor=extractor, tokenizer=tokenizer)
    result.save_pretrained(folder)
    return result


def build(vocab: int) -> Any:
    import torch
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    torch.manual_seed(SEED)
    config = Wav2Vec2Config(
        vocab_size=vocab,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        conv_dim=(16, 16, 16),
        conv_stride=(5, 4, 4),
        conv_kernel=(10, 4, 4),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
        feat_extract_norm="group",
        pad_token_id=0,
        initializer_range=0.5,
    )
    return Wav2Vec2ForCTC(config).eval()


def main() -> None:
    import torch
    from optimum.exporters.onnx import main_export

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    out: Path = parser.parse_args().out
    with tempfile.TemporaryDirectory(prefix="wav2vec2-") as tmp:
        src, onnx_dir = Path(tmp) / "hf", Path(tmp) / "onnx"
        src.mkdir()
        hf = processor(src)
        model = build(len(hf.tokenizer))
        model.save_pretrained(src)
        main_export(str(src), output=str(onnx_dir), task="automatic-speech-recognition")
        copy_export(onnx_dir, out)
    audio = signal()
    np.save(out / "signal.npy", audio)
    features = hf(audio, sampling_rate=RATE, return_tensors="pt")
    with torch.no_grad():
        logits = model(features.input_values).logits.numpy()
    ids = logits.argmax(axis=-1)
    text = hf.batch_decode(ids)[0]
    best = np.sort(logits[0], axis=1)[:, -2:]
    np.savez(out / "reference.npz", logits=logits, input_values=features.input_values.numpy())
    reference = {
        "text": text,
        "frames": int(logits.shape[1]),
        "sample_rate": RATE,
        "gap": float((best[:, 1] - best[:, 0]).min()),  # the smallest top-1/top-2 margin
    }
    (out / "reference.json").write_text(json.dumps(reference, indent=1) + "\n")
    print(f"wav2vec2: {logits.shape} -> {text!r}")


if __name__ == "__main__":
    main()
