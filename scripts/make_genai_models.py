#!/usr/bin/env python3
"""Dev-only: regenerate ``tests/fixtures/real/genai/``: decoders as ONNX Runtime GenAI's model
builder writes them (``python -m onnxruntime_genai.models.builder``), the tool behind
Microsoft's published ONNX language models (the Phi-3 and Phi-4-mini ``*-onnx`` folders) and
Olive's LLM exports.

Not run by CI. Needs ``.venv-export`` (see scripts/export-requirements.txt) with the builder's
package added as that file says::

    .venv-export/bin/pip install --no-deps onnxruntime-genai==0.11.4 onnx-ir==1.1.0
    .venv-export/bin/python scripts/make_genai_models.py [--out tests/fixtures/real/genai]

It builds one seeded random Qwen2-like decoder (grouped-query attention, biases on q/k/v) with
transformers, saves it with the byte-level BPE of ``tests/fixtures/real/decoders/gpt2`` and a
ChatML-like chat template, and runs the builder on that folder twice, for the CPU:

- ``fp32/``: float32 weights, ``model.onnx`` with its weights in ``model.onnx.data``;
- ``int4/``: int4 weights (``MatMulNBits``, block 32, accuracy level 4, as the published
  ``cpu-int4-rtn-block-32-acc-level-4`` folders), the decoder named
  ``qwen2-cpu-int4-rtn-block-32-acc-level-4.onnx`` as those folders name theirs.

Each folder is the builder's output as it is: ``genai_config.json`` (no ``config.json`` nor
``generation_config.json``), the tokenizer's files. ``reference.json``: per prompt and
conversation, the ids, and per folder the tokens of ONNX Runtime GenAI's own greedy generator
(``og.Generator``, ``do_sample=False``); for ``fp32`` also Hugging Face's
``generate(do_sample=False)`` tokens, which the script checks are equal, and the smallest
top-1/top-2 logit gap along their path.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from optimum_export import greedy, pin_environment

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "tests" / "fixtures" / "real" / "genai"
TOKENIZER = REPO_ROOT / "tests" / "fixtures" / "real" / "decoders" / "gpt2" / "tokenizer.json"
EOS = "<|endoftext|>"  # id 0 in that tokenizer
STOP = 304  # a second eos id, a word this seed's greedy paths reach
INT4_FILE = "qwen2-cpu-int4-rtn-block-32-acc-level-4.onnx"
NEW_TOKENS = 24
PROMPTS = ["The little robot", "Edge boxes stream tokens", "日本語 café 🙂"]
CHATS = [[{"role": "user", "content": "Tell the robot a story."}]]
CHAT_TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
BUILDS = {
    "fp32": ["-p", "fp32"],
    "int4": [
        "-p",
        "int4",
        "--extra_options",
        f"filename={INT4_FILE}",
        "int4_block_size=32",
        "int4_accuracy_level=4",
    ],
}


def build_model() -> Any:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=384,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,  # head size 16: GroupQueryAttention's least
        num_key_value_heads=1,
        max_position_embeddings=96,
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=[0, STOP],  # two, as Qwen2's own configs name two
        pad_token_id=0,
    )
    return Qwen2ForCausalLM(config).eval()


def save_source(model: Any, folder: Path) -> Any:
    """The model and its tokenizer (with the chat template) as `save_pretrained` writes them."""
    from transformers import PreTrainedTokenizerFast

    model.save_pretrained(folder)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER), eos_token=EOS)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return tokenizer


def run_builder(source: Path, dst: Path, options: list[str], cache: Path) -> None:
    if dst.exists():
        shutil.rmtree(dst)
    command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(source)]
    command += ["-o", str(dst), "-e", "cpu", "-c", str(cache), *options]
    subprocess.run(command, check=True, capture_output=True)


def genai_greedy(folder: Path, ids: list[int]) -> list[int]:
    """ONNX Runtime GenAI's greedy tokens for `ids` (NEW_TOKENS at most)."""
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(ids) + NEW_TOKENS)
    generator = og.Generator(model, params)
    generator.append_tokens([ids])
    tokens: list[int] = []
    while not generator.is_done():
        generator.generate_next_token()
        tokens.append(int(generator.get_next_tokens()[0]))
    return tokens


def main() -> None:
    pin_environment()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    out = parser.parse_args().out
    model = build_model()
    with tempfile.TemporaryDirectory(prefix="genai-") as tmp:
        source = Path(tmp) / "hf"
        tokenizer = save_source(model, source)
        for name, options in BUILDS.items():
            run_builder(source, out / name, options, Path(tmp) / "cache")
    cases: list[dict[str, Any]] = [
        {"prompt": p, "ids": tokenizer(p)["input_ids"]} for p in PROMPTS
    ] + [
        {"messages": c, "ids": tokenizer.apply_chat_template(c, add_generation_prompt=True)}
        for c in CHATS
    ]
    for case in cases:
        case["hf"], case["gap"] = greedy(model, case["ids"], NEW_TOKENS)
        for name in BUILDS:
            case[name] = genai_greedy(out / name, case["ids"])
        if case["fp32"] != case["hf"]:
            raise SystemExit(f"fp32: the builder's model is not the model: {case}")
        print(case.get("prompt", "chat"), "->", case["fp32"], "| int4:", case["int4"])
    reference = {"eos": [0, STOP], "new_tokens": NEW_TOKENS, "cases": cases}
    text = json.dumps(reference, indent=1, ensure_ascii=False) + "\n"
    (out / "reference.json").write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
