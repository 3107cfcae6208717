#!/usr/bin/env python3
"""Dev-only: regenerate ``tests/fixtures/real/decoders/`` (the `mode = "generate"` fixtures).

Not run by CI. Needs the export stack of ``scripts/make_real_models.py`` (torch,
transformers, optimum-onnx, tokenizers) in ``.venv-export``::

    .venv-export/bin/python scripts/make_decoders.py [--out tests/fixtures/real/decoders]

It writes

- ``tokenizer.json``: a byte-level BPE trained with `tokenizers` on the text below (special
  token ``<|endoftext|>``, the eos);
- ``gpt2/`` and ``llama/``: a seeded random GPT-2-like decoder and a Llama-like one (grouped-
  query attention, rotary positions), each exported with optimum's
  ``text-generation-with-past`` (``model.onnx``), with the ``config.json`` and
  ``generation_config.json`` that ``save_pretrained`` wrote and a copy of ``tokenizer.json``;
- ``gpt2_nocache/``: a smaller seeded GPT-2-like decoder exported with optimum's
  ``text-generation`` task: no cache in or out, the whole sequence every step;
- ``gpt2_merged/``: the same small decoder as optimum's older exports wrote it: a decoder
  without past inputs and one with them, merged by ``optimum.onnx.merge_decoders`` into one
  graph that picks its branch by a ``use_cache_branch`` input;
- ``gpt2_optimized/``: that GPT-2-like export run through ONNX Runtime's transformer optimizer
  (``onnxruntime.transformers.optimizer``, what optimum's ``ORTOptimizer`` calls), whose fused
  operators of the ``com.microsoft`` domain the agent loads as they are;
- ``models/writer/1/``: the GPT-2-like one again, the README's bundled example model
  (with ``--out`` elsewhere, left alone);
- ``reference.json``: per model and prompt, the prompt's token ids, Hugging Face's greedy
  ``generate(do_sample=False)`` tokens and their decoded text, and the smallest gap between
  the best and second-best logit on that path (a tie would make greedy ill-defined).

- ``chat/``: a chat template for the Llama-like one, as ``save_pretrained`` writes it for a
  tokenizer that has one (``chat_template.jinja``, ``tokenizer_config.json``,
  ``special_tokens_map.json``); the tests put these beside ``llama/``'s files. Its
  ``reference.json`` entries (``chat``): per conversation, Hugging Face's
  ``apply_chat_template(add_generation_prompt=True)`` ids and greedy tokens.

- ``gpt2_int8/``: the GPT-2-like export quantized by ONNX Runtime
  (``onnxruntime.quantization.quantize_dynamic``, int8 weights: what optimum's
  ``ORTQuantizer`` and ``optimum-cli onnxruntime quantize`` run), with the other files of the
  folder. Its ``reference.json`` entries (``int8``): a plain ONNX Runtime greedy loop's tokens
  for each prompt: quantized weights are not Hugging Face's, so the framework is ONNX Runtime.

Everything is seeded (torch.manual_seed, a fixed corpus), so a rerun with the same pins
writes the same tokens. ``--optimized-only`` rewrites ``gpt2_optimized/`` from the ``gpt2/``
already there; it needs only onnx, onnxruntime and sympy (the optimizer's shape inference).
``--small-only`` rewrites ``gpt2_nocache/``, ``gpt2_merged/`` and their entries of
``reference.json`` with the tokenizer already there. ``--chat-only`` rewrites ``chat/`` and
the ``chat`` entries, after checking that the seeded Llama-like model it builds again gives
the logits of ``llama/model.onnx``; ``--int8-only`` rewrites ``gpt2_int8/`` and the ``int8``
entries from the ``gpt2/`` already there (onnx and onnxruntime only); ``--beams-only`` adds
to each ``gpt2`` and ``llama`` case ``beam``: ``generate(num_beams=3)``'s tokens and finish,
from the seeded models built again (checked against their greedy references first).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from optimum_export import generated  # this script's folder
from optimum_export import greedy as greedy_with_gap

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "tests" / "fixtures" / "real" / "decoders"
BUNDLED = REPO_ROOT / "models" / "writer" / "1"  # the README's example (config.toml kept)
BUNDLED_FILES = ("model.onnx", "tokenizer.json", "config.json", "generation_config.json")
EOS = "<|endoftext|>"
NOCACHE, MERGED = "gpt2_nocache", "gpt2_merged"  # the small decoder, two ways
VOCAB = 384
NEW_TOKENS = 24
PROMPTS = ["The little robot", "Edge boxes stream tokens", "日本語 café 🙂"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

CORPUS = """\
The little robot woke up in the morning and looked at the sky. It was blue and bright.
Edge boxes stream tokens to their backends over MQTT, one chunk at a time, and keep a spool.
A model runs once for the prompt and then once for every new token; the cache grows by one.
Café au lait, naïve façade, jalapeño, Zürich, São Paulo, Kraków, Ελληνικά, русский язык.
日本語の文章も少し入れておく。東京と大阪。絵文字も 🙂 🚀 ✨ ありがとう。
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
Once upon a time there was a tiny model that could only say a few words, but it tried.
"""


def byte_level_bpe(specials: list[str]) -> Any:
    """A byte-level BPE (`tokenizers.Tokenizer`) of VOCAB tokens trained on CORPUS, the
    `specials` its first ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines() * 4, trainer=trainer)
    return tokenizer


def train_tokenizer(path: Path) -> Any:
    tokenizer = byte_level_bpe([EOS])
    tokenizer.save(str(path))
    return tokenizer


def build(name: str, vocab: int, eos: int) -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    common = {"vocab_size": vocab, "bos_token_id": eos, "eos_token_id": eos, "pad_token_id": eos}
    if name == "gpt2":
        config = GPT2Config(
            n_layer=4, n_head=4, n_embd=128, n_positions=128, initializer_range=0.2, **common
        )
        return GPT2LMHeadModel(config).eval()
    if name in (NOCACHE, MERGED):
        config = GPT2Config(
            n_layer=2, n_head=2, n_embd=32, n_positions=64, initializer_range=0.5, **common
        )
        return GPT2LMHeadModel(config).eval()
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.2,
        tie_word_embeddings=False,
        **common,
    )
    return LlamaForCausalLM(config).eval()


def greedy(model: Any, ids: list[int]) -> tuple[list[int], float]:
    """HF's greedy tokens, and the smallest top-1/top-2 logit gap along the path."""
    return greedy_with_gap(model, ids, NEW_TOKENS)


BEAMS = {"num_beams": 3}


def make_beams(out: Path) -> None:
    """The ``beam`` entries of ``gpt2`` and ``llama`` (see the module docstring)."""
    reference = json.loads((out / "reference.json").read_text(encoding="utf-8"))
    vocab, eos = reference["vocab"], reference["eos"]
    for name in ("gpt2", "llama"):
        model = build(name, vocab, eos)
        for case in reference["models"][name]:
            if greedy(model, case["ids"])[0] != case["greedy"]:
                raise SystemExit(f"{name}: the model built again is not the exported one")
            searched = generated(model, case["ids"], NEW_TOKENS, **BEAMS)
            tokens = searched.sequences[0, len(case["ids"]) :].tolist()
            finish = "eos" if tokens and tokens[-1] == eos else "length"
            case["beam"] = {"tokens": tokens, "finish": finish}
            print(f"{name}: {case['prompt']!r} beams -> {tokens} {finish}")
    write_reference(out, reference)


def export(model: Any, dst: Path, task: str = "text-generation-with-past") -> None:
    from optimum.exporters.onnx import main_export

    with tempfile.TemporaryDirectory(prefix="decoder-export-") as tmp:
        src, onnx_dir = Path(tmp) / "hf", Path(tmp) / "onnx"
        model.save_pretrained(src)
        main_export(str(src), output=str(onnx_dir), task=task, device="cpu")
        dst.mkdir(parents=True, exist_ok=True)
        shutil.copy(onnx_dir / "model.onnx", dst / "model.onnx")
        for extra in ("config.json", "generation_config.json"):
            shutil.copy(src / extra, dst / extra)


def export_merged(model: Any, dst: Path) -> None:
    """`model` as optimum's older exports wrote a decoder: one without past inputs (its cache
    out), one with them, merged into one graph choosing by `use_cache_branch`."""
    from optimum.exporters.onnx import export as export_config
    from optimum.exporters.onnx.model_configs import GPT2OnnxConfig
    from optimum.onnx import merge_decoders

    with tempfile.TemporaryDirectory(prefix="decoder-merge-") as tmp:
        parts = []
        for past_in in (False, True):
            config = GPT2OnnxConfig(
                model.config, task="text-generation", use_past=True, use_past_in_inputs=past_in
            )
            parts.append(Path(tmp) / f"decoder-{past_in}.onnx")
            export_config(model, config, parts[-1], opset=14)
        dst.mkdir(parents=True, exist_ok=True)
        merge_decoders(parts[0], parts[1], save_path=dst / "model.onnx")
        model.save_pretrained(Path(tmp) / "hf")
        for extra in ("config.json", "generation_config.json"):
            shutil.copy(Path(tmp) / "hf" / extra, dst / extra)


EXPORTS: dict[str, Callable[[Any, Path], None]] = {
    "gpt2": export,
    "llama": export,
    NOCACHE: lambda model, dst: export(model, dst, "text-generation"),
    MERGED: export_merged,
}


def optimize(src: Path, dst: Path) -> None:
    """`src`'s GPT-2 export fused by ONNX Runtime's transformer optimizer into `dst`, with the
    other files of the folder. `opt_level=0`: only the optimizer's own fusions (layer norms,
    GELU), none of a provider's, so the file runs on any provider that has the fused ops."""
    from onnxruntime.transformers.optimizer import optimize_model

    config = json.loads((src / "config.json").read_text(encoding="utf-8"))
    model = optimize_model(
        str(src / "model.onnx"),
        model_type="gpt2",
        num_heads=config["n_head"],
        hidden_size=config["n_embd"],
        opt_level=0,
    )
    fused = {op: n for op, n in model.get_fused_operator_statistics().items() if n}
    print(f"{dst.name}: {fused}")
    dst.mkdir(parents=True, exist_ok=True)
    model.save_model_to_file(str(dst / "model.onnx"))
    for extra in ("config.json", "generation_config.json", "tokenizer.json"):
        shutil.copy(src / extra, dst / extra)


def make(name: str, tokenizer: Any, out: Path) -> list[dict[str, Any]]:
    """`out/name/`: the seeded decoder `name` exported (`EXPORTS`), with the tokenizer; its
    reference cases (Hugging Face's greedy tokens for each prompt)."""
    vocab, eos = tokenizer.get_vocab_size(), tokenizer.token_to_id(EOS)
    model = build(name, vocab, eos)
    EXPORTS[name](model, out / name)
    tokenizer.save(str(out / name / "tokenizer.json"))
    cases = []
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt).ids
        tokens, gap = greedy(model, ids)
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        cases.append({"prompt": prompt, "ids": ids, "greedy": tokens, "text": text, "gap": gap})
        print(f"{name}: {prompt!r} -> {tokens} (min gap {gap:.3f})")
    return cases


CHAT_TEMPLATE = (  # a plain template that uses what transformers gives one: raise_exception,
    # the special tokens, add_generation_prompt
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{%- endif %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] | trim }}{{ eos_token }}\n"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}Assistant:{% endif %}"
)
CHATS = [
    [{"role": "user", "content": "Where is the little robot?"}],
    [
        {"role": "system", "content": "You answer in one line."},
        {"role": "user", "content": "Stream tokens, please."},
        {"role": "assistant", "content": "Edge boxes stream tokens."},
        {"role": "user", "content": " Café 🙂 again "},
    ],
]


def make_chat(out: Path) -> list[dict[str, Any]]:
    """`out/chat/`: CHAT_TEMPLATE saved as transformers saves a tokenizer's template; per
    conversation of CHATS, `apply_chat_template`'s ids and the Llama-like model's greedy
    tokens (the model built again, checked against `out/llama/model.onnx` first)."""
    import numpy as np
    import onnxruntime as ort
    import torch
    from transformers import PreTrainedTokenizerFast

    llama = out / "llama"
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(llama / "tokenizer.json"), eos_token=EOS, bos_token=EOS
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    model = build("llama", tokenizer.vocab_size, tokenizer.eos_token_id)
    ids = tokenizer.apply_chat_template(CHATS[0], add_generation_prompt=True)
    session = ort.InferenceSession(str(llama / "model.onnx"), providers=["CPUExecutionProvider"])
    feed = _prefill_feed(session, ids)
    onnx_logits = session.run(["logits"], feed)[0]
    with torch.no_grad():
        torch_logits = model(torch.tensor([ids])).logits.numpy()
    difference = float(np.abs(onnx_logits - torch_logits).max())
    if difference > 1e-4:
        raise SystemExit(f"the rebuilt llama differs from llama/model.onnx by {difference}")
    with tempfile.TemporaryDirectory(prefix="chat-") as tmp:
        tokenizer.save_pretrained(tmp)
        (out / "chat").mkdir(parents=True, exist_ok=True)
        for name in ("chat_template.jinja", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(Path(tmp) / name, out / "chat" / name)
    cases = []
    for chat in CHATS:
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True)
        tokens, gap = greedy(model, ids)
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        cases.append({"messages": chat, "ids": ids, "greedy": tokens, "text": text, "gap": gap})
        print(f"chat: {len(chat)} messages, {len(ids)} ids -> {tokens} (min gap {gap:.3f})")
    return cases


INT8 = "gpt2_int8"


def make_int8(out: Path) -> list[dict[str, Any]]:
    """`out/gpt2_int8/`: `out/gpt2/` with its weights quantized to int8 (dynamic
    quantization); per prompt of the reference, ONNX Runtime's greedy tokens."""
    import onnxruntime as ort
    from onnxruntime.quantization import QuantType, quantize_dynamic

    src, dst = out / "gpt2", out / INT8
    dst.mkdir(parents=True, exist_ok=True)
    quantize_dynamic(src / "model.onnx", dst / "model.onnx", weight_type=QuantType.QInt8)
    for extra in ("config.json", "generation_config.json", "tokenizer.json"):
        shutil.copy(src / extra, dst / extra)
    session = ort.InferenceSession(str(dst / "model.onnx"), providers=["CPUExecutionProvider"])
    reference = json.loads((out / "reference.json").read_text(encoding="utf-8"))
    cases = []
    for case in reference["models"]["gpt2"]:
        tokens, gap = ort_greedy(session, case["ids"], NEW_TOKENS)
        cases.append({"prompt": case["prompt"], "ids": case["ids"], "greedy": tokens, "gap": gap})
        print(f"{INT8}: {case['prompt']!r} -> {tokens} (min gap {gap:.3f})")
    return cases


def ort_greedy(session: Any, ids: list[int], new_tokens: int) -> tuple[list[int], float]:
    """A plain ONNX Runtime greedy loop over an optimum decoder with its cache, and the
    smallest top-1/top-2 logit gap along the path."""
    import numpy as np

    outputs = [o.name for o in session.get_outputs()]
    feed = _prefill_feed(session, ids)
    tokens: list[int] = []
    gaps: list[float] = []
    for _ in range(new_tokens):
        result = dict(zip(outputs, session.run(outputs, feed), strict=True))
        logits = result["logits"][0, -1]
        best = np.sort(logits)[-2:]
        gaps.append(float(best[1] - best[0]))
        tokens.append(int(np.argmax(logits)))
        past = feed["attention_mask"].shape[1]
        feed = {
            "input_ids": np.array([[tokens[-1]]], np.int64),
            "attention_mask": np.ones((1, past + 1), np.int64),
            "position_ids": np.array([[past]], np.int64),
        }
        for name in result:
            if name.startswith("present."):
                feed[name.replace("present", "past_key_values")] = result[name]
    return tokens, min(gaps)


def _prefill_feed(session: Any, ids: list[int]) -> dict[str, Any]:
    """A prefill's inputs for an optimum decoder: the ids, ones, positions, empty caches."""
    import numpy as np

    feed: dict[str, Any] = {
        "input_ids": np.array([ids], np.int64),
        "attention_mask": np.ones((1, len(ids)), np.int64),
        "position_ids": np.arange(len(ids), dtype=np.int64)[None],
    }
    for spec in session.get_inputs():
        if spec.name.startswith("past_key_values."):
            heads, size = spec.shape[1], spec.shape[3]
            feed[spec.name] = np.zeros((1, heads, 0, size), np.float32)
    return feed


def write_reference(out: Path, reference: dict[str, Any]) -> None:
    (out / "reference.json").write_text(json.dumps(reference, indent=1, ensure_ascii=False) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--optimized-only", action="store_true")
    parser.add_argument("--small-only", action="store_true")
    parser.add_argument("--chat-only", action="store_true")
    parser.add_argument("--int8-only", action="store_true")
    parser.add_argument("--beams-only", action="store_true")
    args = parser.parse_args()
    out: Path = args.out
    if args.beams_only:
        make_beams(out)
        return
    if args.int8_only:
        reference = json.loads((out / "reference.json").read_text(encoding="utf-8"))
        reference["int8"] = make_int8(out)
        write_reference(out, reference)
        return
    if args.chat_only:
        reference = json.loads((out / "reference.json").read_text(encoding="utf-8"))
        reference["chat"] = make_chat(out)
        write_reference(out, reference)
        return
    if args.optimized_only:
        optimize(out / "gpt2", out / "gpt2_optimized")
        return
    if args.small_only:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(out / "gpt2" / "tokenizer.json"))
        reference = json.loads((out / "reference.json").read_text(encoding="utf-8"))
        for name in (NOCACHE, MERGED):
            reference["models"][name] = make(name, tokenizer, out)
        write_reference(out, reference)
        return
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(out / "tokenizer.json")
    vocab, eos = tokenizer.get_vocab_size(), tokenizer.token_to_id(EOS)
    reference = {"eos": eos, "vocab": vocab, "models": {}}
    for name in EXPORTS:
        reference["models"][name] = make(name, tokenizer, out)
    (out / "tokenizer.json").unlink()  # each model folder has its copy
    reference["chat"] = make_chat(out)
    write_reference(out, reference)
    reference["int8"] = make_int8(out)
    write_reference(out, reference)
    optimize(out / "gpt2", out / "gpt2_optimized")
    if out.resolve() == DEFAULT_OUT.resolve():
        BUNDLED.mkdir(parents=True, exist_ok=True)
        for name in BUNDLED_FILES:
            shutil.copy(out / "gpt2" / name, BUNDLED / name)


if __name__ == "__main__":
    main()
