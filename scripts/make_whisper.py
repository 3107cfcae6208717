#!/usr/bin/env python3
"""Dev-only: regenerate ``tests/fixtures/real/whisper/`` (a speech recogniser for `generate`).

Not run by CI. Needs the export stack of ``scripts/make_real_models.py`` (torch,
transformers, optimum-onnx, tokenizers) in ``.venv-export``::

    .venv-export/bin/python scripts/make_whisper.py [--out tests/fixtures/real/whisper]

It writes one version folder as a user copies optimum's ``automatic-speech-recognition-with-past``
export of a seeded random ``WhisperForConditionalGeneration`` (width 32, 2 + 2 layers, 4 heads,
80 mel bins, 1500 encoder positions: Whisper's own 30 s window): ``encoder_model.onnx``
(``input_features [batch, 80, 3000]`` in, ``last_hidden_state`` out), ``model.onnx`` (optimum's
merged decoder, ``decoder_model_merged.onnx`` renamed), and ``config.json``,
``generation_config.json``, ``preprocessor_config.json`` (``WhisperFeatureExtractor``),
``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json`` as the export left
them.

The tokenizer is make_decoders' byte-level BPE with Whisper's special tokens after the
vocabulary, in Whisper's order (``<|endoftext|>``, ``<|startoftranscript|>``, three languages,
``<|translate|>``, ``<|transcribe|>``, ``<|startoflm|>``, ``<|startofprev|>``,
``<|nospeech|>``, ``<|notimestamps|>`` last: no timestamp tokens, so none can be taken for
one). ``generation_config.json`` is laid out as a multilingual checkpoint's: ``lang_to_id``,
``task_to_id``, ``is_multilingual``, ``no_timestamps_token_id``, ``forced_decoder_ids``
``[[1, null], [2, transcribe]]`` (the language detected, then transcription),
``suppress_tokens`` and ``begin_suppress_tokens``.

``reference.npz``: the test clips (float32 samples at 16 kHz: a tone sweep, a chord with noise,
noise bursts) and ``WhisperFeatureExtractor``'s ``input_features`` of each.
``reference.json``: the special ids, the signatures, and per case (a clip with a language and
a task, or neither: detection; some after a previous text, ``text_prompt``) Hugging Face's
``generate(do_sample=False, max_new_tokens=NEW_TOKENS)``: its prompt (the previous text's ids
and ``init_tokens``), the new tokens, the finish, the text
(``decode(skip_special_tokens=True)``), and the smallest gap between the best and second-best
allowed logit on that path (suppressed tokens left out); and ``generate(num_beams=3)``'s new
tokens (``beam``).

Everything is seeded; the references are PyTorch's on its AVX2 kernels with two threads, and
the script runs itself again with ``PYTHONHASHSEED=0`` (optimum's merge names shared weights
in set order), so a rerun with the same pins writes the same bytes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from make_decoders import byte_level_bpe  # this script's folder
from make_real_models import _reexec_with_fixed_hash_seed  # optimum's merge: set order
from optimum_export import export_kept, pin_environment, signature

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "tests" / "fixtures" / "real" / "whisper"
NEW_TOKENS = 16
RATE = 16000
SEED = 18  # its free steps all stand 0.01 above the second best (ORT differs by 6e-5)
STD = 1.0  # WhisperConfig.init_std: at its own 0.02 every logit is within 1e-3 of the others
THREADS = 2
LANGUAGES = ["en", "de", "fr"]
SPECIALS = [
    "<|endoftext|>",
    "<|startoftranscript|>",
    *[f"<|{code}|>" for code in LANGUAGES],
    "<|translate|>",
    "<|transcribe|>",
    "<|startoflm|>",
    "<|startofprev|>",
    "<|nospeech|>",
    "<|notimestamps|>",
]
# (clip, language, task, prompt): None lets generate pick (detection; the forced task); a
# prompt is the text of a previous piece, given as `prompt_ids` (`get_prompt_ids`' layout)
CASES = [
    ("sweep", "en", "transcribe", None),
    ("sweep", None, None, None),
    ("chord", "de", "translate", None),
    ("chord", None, None, None),
    ("bursts", "fr", None, None),
    ("bursts", None, "translate", None),
    ("sweep", "en", "transcribe", "The little robot woke up."),
    ("chord", None, None, " Edge boxes stream tokens "),
]
pin_environment()


def clips() -> dict[str, Any]:
    """The seeded test signals, float32 at RATE."""
    import numpy as np

    rng = np.random.default_rng(7)
    t = np.arange(int(1.5 * RATE)) / RATE
    sweep = 0.5 * np.sin(2 * np.pi * (200 + 900 * t) * t)
    t = np.arange(int(2.5 * RATE)) / RATE
    chord = sum(0.2 * np.sin(2 * np.pi * f * t) for f in (262, 330, 392))
    chord = chord + 0.05 * rng.standard_normal(t.size)
    bursts = np.zeros(4 * RATE)
    for start in (0.3, 1.4, 2.9):
        at = int(start * RATE)
        bursts[at : at + RATE // 3] = 0.4 * rng.standard_normal(RATE // 3)
    return {
        name: np.asarray(x, dtype=np.float32)
        for name, x in (("sweep", sweep), ("chord", chord), ("bursts", bursts))
    }


def build_tokenizer() -> Any:
    """make_decoders' BPE, Whisper's specials after its vocabulary, as a fast tokenizer."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    tokenizer = byte_level_bpe([])
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        model_max_length=448,
    )


def build(tokenizer: Any) -> Any:
    """The seeded random model, its generation config a multilingual checkpoint's."""
    import torch
    from transformers import GenerationConfig, WhisperConfig, WhisperForConditionalGeneration

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIALS}
    eos = ids["<|endoftext|>"]
    space = tokenizer.convert_tokens_to_ids("Ġ")
    # As Whisper's: punctuation, and a space or the eos first; with "Ġa" and "s", which this
    # seed's model takes often, so that the references differ from an unsuppressed greedy.
    suppress = [tokenizer.convert_tokens_to_ids(t) for t in ("!", '"', "#", "Ġa")]
    begin = [space, eos, tokenizer.convert_tokens_to_ids("s")]
    torch.manual_seed(SEED)
    config = WhisperConfig(
        vocab_size=len(tokenizer),
        num_mel_bins=80,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_source_positions=1500,
        max_target_positions=448,
        init_std=STD,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
        decoder_start_token_id=ids["<|startoftranscript|>"],
        suppress_tokens=suppress,
        begin_suppress_tokens=begin,
    )
    model = WhisperForConditionalGeneration(config).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
        decoder_start_token_id=ids["<|startoftranscript|>"],
        max_length=448,
        suppress_tokens=suppress,
        begin_suppress_tokens=begin,
        lang_to_id={f"<|{code}|>": ids[f"<|{code}|>"] for code in LANGUAGES},
        task_to_id={"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]},
        is_multilingual=True,
        no_timestamps_token_id=ids["<|notimestamps|>"],
        forced_decoder_ids=[[1, None], [2, ids["<|transcribe|>"]]],
    )
    return model


def export(model: Any, tokenizer: Any, extractor: Any, dst: Path) -> None:
    """`dst` made anew with the files of optimum's export of `model`."""

    def save(src: Path) -> None:
        model.save_pretrained(src)
        tokenizer.save_pretrained(src)
        extractor.save_pretrained(src)

    export_kept(save, "automatic-speech-recognition-with-past", dst)


def prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """`WhisperTokenizer.get_prompt_ids`' layout: `<|startofprev|>`, then the text stripped
    with one leading space, no special tokens added."""
    pair = tokenizer("<|startofprev|>", " " + text.strip(), add_special_tokens=False)
    return list(pair["input_ids"])


def greedy(
    model: Any, features: Any, language: str | None, task: str | None, prompt: list[int]
) -> dict[str, Any]:
    """Hugging Face's greedy generation for one clip: its prompt, new tokens and the smallest
    gap between the two best allowed logits along the path."""
    import torch

    kwargs: dict[str, Any] = {"do_sample": False, "max_new_tokens": NEW_TOKENS}
    if language is not None:
        kwargs["language"] = language
    if task is not None:
        kwargs["task"] = task
    if prompt:
        kwargs["prompt_ids"] = torch.tensor(prompt)
    with torch.no_grad():
        tokens = model.generate(torch.from_numpy(features), **kwargs)[0].tolist()
        init = model._retrieve_init_tokens(
            torch.from_numpy(features),
            1,
            _config_for(model, language, task),
            model.config,
            3000,
            {},
        )[0].tolist()
    init = prompt + init
    sequence = init + tokens  # generate returns the new tokens alone
    generation = model.generation_config
    with torch.no_grad():
        logits = model(
            input_features=torch.from_numpy(features),
            decoder_input_ids=torch.tensor([sequence[:-1]]),
        ).logits[0]
    gaps = []
    for step, token in enumerate(tokens):
        row = logits[len(init) - 1 + step].clone()
        row[generation.suppress_tokens] = -float("inf")
        if step == 0:
            row[generation.begin_suppress_tokens] = -float("inf")
        top = row.topk(2).values
        assert int(row.argmax()) == token, (step, token, int(row.argmax()))
        gaps.append(float(top[0] - top[1]))
    finish = "eos" if tokens and tokens[-1] == generation.eos_token_id else "length"
    with torch.no_grad():
        beams = model.generate(torch.from_numpy(features), num_beams=3, **kwargs)[0].tolist()
    return {"prompt": init, "tokens": tokens, "finish": finish, "gap": min(gaps), "beam": beams}


def _config_for(model: Any, language: str | None, task: str | None) -> Any:
    """The generation config as generate sets it for `language` and `task`."""
    import copy

    config = copy.deepcopy(model.generation_config)
    config.language = language
    config.task = task
    config.return_timestamps = False
    return config


def main() -> None:
    _reexec_with_fixed_hash_seed()
    import numpy as np
    import torch
    from transformers import AutoTokenizer, WhisperFeatureExtractor

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    out: Path = parser.parse_args().out
    torch.set_num_threads(THREADS)
    extractor = WhisperFeatureExtractor(feature_size=80, sampling_rate=RATE)
    model = build(build_tokenizer())
    export(model, build_tokenizer(), extractor, out)
    tokenizer = AutoTokenizer.from_pretrained(out)  # what a user would load
    signals = clips()
    features = {
        name: extractor(x, sampling_rate=RATE, return_tensors="np")["input_features"]
        for name, x in signals.items()
    }
    cases = []
    for clip, language, task, text in CASES:
        case = {"clip": clip, "language": language, "task": task, "text_prompt": text}
        ids = prompt_ids(tokenizer, text) if text is not None else []
        case.update(greedy(model, features[clip], language, task, ids))
        case["text"] = tokenizer.decode(case["tokens"], skip_special_tokens=True)
        print(
            f"{clip} {language} {task}: {case['prompt']} -> {case['tokens']} "
            f"{case['finish']} (gap {case['gap']:.4f})"
        )
        cases.append(case)
    generation = model.generation_config
    reference = {
        "seed": SEED,
        "new_tokens": NEW_TOKENS,
        "vocab": len(tokenizer),
        "sampling_rate": RATE,
        "ids": {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIALS},
        "suppress_tokens": generation.suppress_tokens,
        "begin_suppress_tokens": generation.begin_suppress_tokens,
        "gap": min(case["gap"] for case in cases),
        "encoder": signature(out / "encoder_model.onnx"),
        "decoder": signature(out / "model.onnx"),
        "cases": cases,
    }
    text = json.dumps(reference, indent=1, ensure_ascii=False)
    (out / "reference.json").write_text(text + "\n", encoding="utf-8")
    arrays = {f"audio_{k}": v for k, v in signals.items()}
    arrays |= {f"features_{k}": v.astype(np.float32) for k, v in features.items()}
    np.savez_compressed(out / "reference.npz", **arrays)


if __name__ == "__main__":
    main()
