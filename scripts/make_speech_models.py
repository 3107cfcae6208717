#!/usr/bin/env python3
"""Dev-only: regenerate ``tests/fixtures/real/wav2vec2/`` (a CTC speech recogniser) and
``tests/fixtures/real/wav2vec2_classifier/`` (a keyword spotter).

Not run by CI. Needs the export stack of ``scripts/make_real_models.py`` (torch,
transformers, optimum-onnx) in ``.venv-export``::

    .venv-export/bin/python scripts/make_speech_models.py [--out tests/fixtures/real/wav2vec2]
        [--classifier-out tests/fixtures/real/wav2vec2_classifier]

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
``processor.batch_decode``; the logits in ``reference.npz``. ``windows.json`` and
``windows.npz``: the same for each window of a ``[scan]`` over the signal (half a second, a
hop of 5000 samples, 2000 zeros before the first), each window normalised on its own by the
processor, as the chunked ASR pipeline normalises each chunk.

The keyword spotter is a seeded random ``Wav2Vec2ForSequenceClassification`` of the same
small shape (frames mean-pooled, a projection of 16, six labels: yes, no, up, down, silence,
unknown in ``config.json``'s ``id2label``) exported with optimum's ``audio-classification``
task (``input_values [batch, samples]`` in, ``logits [batch, 6]`` out), with its
``config.json`` and the same ``preprocessor_config.json``. ``reference.npz`` holds two clips
as recorded (``signal``, the recogniser's two seconds, and ``short``, half a second of noise
and a chirp), each with the feature extractor's ``*_input_values`` and the PyTorch model's
``*_logits``; ``reference.json`` what ``pipeline("audio-classification")`` answers for each
(``top_k`` 3: labels and scores). No padded batch: for a model without an attention mask
(``feat_extract_norm="group"``) the pipeline's padding changes the answer.

The references are PyTorch's on its AVX2 kernels with two threads (set below): the committed
recogniser's logits were made so, and AVX-512 kernels or one thread differ by about 1e-4,
enough to change the files' bytes (never the tests' outcome).
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
DEFAULT_CLASSIFIER_OUT = REPO_ROOT / "tests" / "fixtures" / "real" / "wav2vec2_classifier"
RATE = 16000
CHARACTERS = "abcdefghijklmnopqrstuvwxyz'"
# A seed whose frames keep their best class clear of the second (0.011 at least, where ONNX
# Runtime and PyTorch differ by 1e-4) and have blanks among them (15 %).
SEED = 2
# The word delimiter's class: one that model picks often, so that the text has words. (A
# random model's best classes are few; with `|` after the specials it never picked it.)
DELIMITER_ID = 16
# The windows of a scan over the signal (tests/test_speech_windows.py): half a second each,
# a hop of 5000 samples, 2000 zeros before the first: of the windows, hops and leads tried,
# one with a lead whose frames keep their best class clear of the second (0.0059 at least).
WINDOW, WINDOW_HOP, WINDOW_LEAD = 8000, 5000, 2000
KEYWORDS = ("yes", "no", "up", "down", "silence", "unknown")
TOP_K = 3
# The first of seeds 0 to 39 whose pipeline scores are spread (the best under 0.7 for both
# clips, so the scores are not all 1 and 0), whose four best scores of each clip stand 0.05
# apart at least (ONNX Runtime and PyTorch differ by 1e-4: the top 3 and their order are
# the same in both), and whose best label differs between the clips (down, up).
CLASSIFIER_SEED = 28
THREADS = 2  # PyTorch's results with one thread differ (see above)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Before torch loads: its own and oneDNN's kernels, as the committed references were made.
os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
os.environ.setdefault("DNNL_MAX_CPU_ISA", "AVX2")


def signal() -> np.ndarray[Any, Any]:
    """Two seconds: noise, three tone bursts of different pitch and loudness, a quiet gap."""
    rng = np.random.default_rng(7)
    t = np.arange(2 * RATE) / RATE
    x = 0.02 * rng.standard_normal(t.size)
    for start, pitch, loud in ((0.2, 220.0, 0.5), (0.8, 660.0, 0.3), (1.3, 1200.0, 0.6)):
        burst = (t >= start) & (t < start + 0.35)
        x[burst] += loud * np.sin(2 * np.pi * pitch * t[burst])
    return x.astype(np.float32)


def short_signal() -> np.ndarray[Any, Any]:
    """Half a second: louder noise and a rising chirp (300 Hz up), faded in and out."""
    rng = np.random.default_rng(11)
    t = np.arange(RATE // 2) / RATE
    x = 0.05 * rng.standard_normal(t.size)
    x += 0.4 * np.sin(2 * np.pi * (300.0 + 1500.0 * t) * t) * np.hanning(t.size)
    return x.astype(np.float32)


def feature_extractor() -> Any:
    """Wav2Vec2's feature extractor at 16 kHz, each recording to zero mean and unit variance."""
    from transformers import Wav2Vec2FeatureExtractor

    return Wav2Vec2FeatureExtractor(
        feature_size=1, sampling_rate=RATE, padding_value=0.0, do_normalize=True
    )


def processor(folder: Path) -> Any:
    """A Wav2Vec2Processor with a character vocabulary, saved into `folder`."""
    from transformers import Wav2Vec2CTCTokenizer, Wav2Vec2Processor

    tokens = ["<pad>", "<s>", "</s>", "<unk>", *CHARACTERS]
    tokens.insert(DELIMITER_ID, "|")
    vocab = {token: i for i, token in enumerate(tokens)}
    (folder / "vocab.json").write_text(json.dumps(vocab))
    tokenizer = Wav2Vec2CTCTokenizer(str(folder / "vocab.json"))
    result = Wav2Vec2Processor(feature_extractor=feature_extractor(), tokenizer=tokenizer)
    result.save_pretrained(folder)
    return result


def small_config(**extra: Any) -> Any:
    """The small wav2vec2 both models share (a frame every 80 samples, width 32), with the
    head's settings in `extra`."""
    from transformers import Wav2Vec2Config

    return Wav2Vec2Config(
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
        **extra,
    )


def build(vocab: int) -> Any:
    import torch
    from transformers import Wav2Vec2ForCTC

    torch.manual_seed(SEED)
    return Wav2Vec2ForCTC(small_config(vocab_size=vocab)).eval()


def build_classifier() -> Any:
    """The keyword spotter: mean-pooled frames, a projection of 16, one logit a keyword."""
    import torch
    from transformers import Wav2Vec2ForSequenceClassification

    torch.manual_seed(CLASSIFIER_SEED)
    config = small_config(
        num_labels=len(KEYWORDS),
        id2label=dict(enumerate(KEYWORDS)),
        label2id={label: i for i, label in enumerate(KEYWORDS)},
        classifier_proj_size=16,
    )
    return Wav2Vec2ForSequenceClassification(config).eval()


def make_recogniser(out: Path) -> None:
    """`out`: the CTC recogniser, its processor's files, the signal and Hugging Face's text."""
    import torch
    from optimum.exporters.onnx import main_export

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
    write_windows(out, model, hf, audio)


def write_windows(out: Path, model: Any, hf: Any, audio: np.ndarray[Any, Any]) -> None:
    """`out/windows.json` and `windows.npz`: the signal cut as a `[scan]` of WINDOW, HOP and
    LEAD cuts it (window k: samples `[k * HOP - LEAD, k * HOP - LEAD + WINDOW)`, zeros before
    the first, the partial last dropped), each window through the processor on its own (as the
    chunked ASR pipeline's `chunk_iter` runs the feature extractor on each chunk), the PyTorch
    model and `batch_decode`."""
    import torch

    padded = np.concatenate([np.zeros(WINDOW_LEAD, np.float32), audio])
    starts = list(range(0, padded.size - WINDOW + 1, WINDOW_HOP))
    logits, texts, gaps = [], [], []
    for start in starts:
        features = hf(padded[start : start + WINDOW], sampling_rate=RATE, return_tensors="pt")
        with torch.no_grad():
            window_logits = model(features.input_values).logits.numpy()
        logits.append(window_logits)
        texts.append(hf.batch_decode(window_logits.argmax(axis=-1))[0])
        best = np.sort(window_logits[0], axis=1)[:, -2:]
        gaps.append(float((best[:, 1] - best[:, 0]).min()))
    np.savez(out / "windows.npz", logits=np.stack(logits))
    windows = {
        "window": WINDOW,
        "hop": WINDOW_HOP,
        "lead": WINDOW_LEAD,
        "rate": RATE,
        "starts": starts,
        "texts": texts,
        "gap": min(gaps),  # the smallest top-1/top-2 margin of any window's frame
    }
    (out / "windows.json").write_text(json.dumps(windows, indent=1) + "\n")
    print(f"wav2vec2 windows: {texts}")


def make_classifier(out: Path) -> None:
    """`out`: the keyword spotter, its configs, and Hugging Face's answers for two clips."""
    from optimum.exporters.onnx import main_export
    from transformers import pipeline

    extractor = feature_extractor()
    model = build_classifier()
    with tempfile.TemporaryDirectory(prefix="wav2vec2-classifier-") as tmp:
        src, onnx_dir = Path(tmp) / "hf", Path(tmp) / "onnx"
        extractor.save_pretrained(src)
        model.save_pretrained(src)
        main_export(str(src), output=str(onnx_dir), task="audio-classification")
        copy_export(onnx_dir, out)
    classify = pipeline("audio-classification", model=model, feature_extractor=extractor)
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    clips: dict[str, Any] = {}
    for name, audio in (("signal", signal()), ("short", short_signal())):
        values, logits = hf_logits(model, extractor, audio)
        arrays |= {name: audio, f"{name}_input_values": values, f"{name}_logits": logits}
        answer = classify(audio, top_k=TOP_K)
        clips[name] = {
            "samples": int(audio.size),
            "labels": [a["label"] for a in answer],
            "scores": [a["score"] for a in answer],
            "gap": score_gap(logits[0]),
        }
        print(f"wav2vec2_classifier {name}: {answer}")
    np.savez(out / "reference.npz", **arrays)
    reference = {"sample_rate": RATE, "top_k": TOP_K, "clips": clips}
    (out / "reference.json").write_text(json.dumps(reference, indent=1) + "\n")


def hf_logits(
    model: Any, extractor: Any, audio: np.ndarray[Any, Any]
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """The feature extractor's `input_values` of one clip and the PyTorch model's logits."""
    import torch

    values = extractor(audio, sampling_rate=RATE, return_tensors="pt").input_values
    with torch.no_grad():
        logits = model(values).logits.numpy()
    return values.numpy(), logits


def score_gap(logits: np.ndarray[Any, Any]) -> float:
    """The smallest difference between neighbours of the TOP_K + 1 best softmax scores."""
    scores = np.exp(logits - logits.max())
    best = np.sort(scores / scores.sum())[::-1][: TOP_K + 1]
    return float((best[:-1] - best[1:]).min())


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--classifier-out", type=Path, default=DEFAULT_CLASSIFIER_OUT)
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    make_recogniser(args.out)
    make_classifier(args.classifier_out)


if __name__ == "__main__":
    main()
