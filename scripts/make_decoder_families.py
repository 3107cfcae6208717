#!/usr/bin/env python3
"""Dev-only: regenerate ``tests/fixtures/real/families/`` (decoder architectures users bring
to `mode = "generate"`, beyond the GPT-2-like and Llama-like ones of make_decoders.py).

Not run by CI. Needs the export stack of ``scripts/make_real_models.py`` (torch,
transformers, optimum-onnx, tokenizers) in ``.venv-export``::

    .venv-export/bin/python scripts/make_decoder_families.py [--out tests/fixtures/real/families]

For each family of FAMILIES, a seeded random model (``torch.manual_seed`` before
``AutoConfig.for_model(family, ...)`` and ``AutoModelForCausalLM.from_config``), tiny: width
32, 2 layers, 4 heads of 8 (2 key/value heads where the family groups them), feed-forward
64, vocabulary 384 (make_decoders' byte-level BPE, eos id 0), 64 positions, weights drawn
at 0.2 so no two logits sit near a tie, the head tied to the embeddings (a smaller file)
but in gemma2 and granite. What each family adds to the existing fixtures:

- ``qwen2``: grouped-query attention with biases on q, k and v;
- ``phi3``: q, k and v fused in one projection (and gate and up in one), split in the graph;
- ``gemma2``: no ``position_ids`` input, attention and final logits soft-capped (tanh), a
  sliding window of 16 on its first layer (the prompts and their tokens go past it), a
  query scale of its own, embeddings scaled by the square root of the width (its head
  untied: tied, a random one only repeats the prompt's last token);
- ``bloom``: ALiBi (no rotary, no learned positions: no ``position_ids``), fused qkv,
  an embedding layer norm (weights drawn at 1.0: at 0.2 its tied head repeats a token);
- ``mpt``: ALiBi again (no ``position_ids``), no biases, MosaicML's own modelling code in
  transformers;
- ``falcon``: multi-query attention (one key/value head), attention and MLP in parallel
  from one layer norm;
- ``gpt_neox``: rotary on a quarter of each head only, parallel residual, fused qkv;
- ``opt``: learned positions offset by 2, ReLU, biases;
- ``gpt_bigcode``: multi-query attention with learned positions, GPT-2's layout otherwise
  (its cache, fused as ``past_key_values.N.key_value`` in older exports, is a key and a
  value of one head in this one);
- ``stablelm``: partial rotary (a quarter), LayerNorm rather than RMSNorm, qkv biases;
- ``qwen3``: an RMSNorm on each head's queries and keys, an explicit ``head_dim``;
- ``granite``: Llama-like with embedding, residual, attention and logits multipliers.

Each family's folder ``<family>/`` holds optimum's ``text-generation-with-past`` export as
a user copies it: ``model.onnx``, ``config.json``, ``generation_config.json`` (the
tokenizer is not copied: the tests take ``decoders/gpt2/tokenizer.json`` where they need
text). The exports' inputs (each recorded in ``reference.json``): ``input_ids``,
``attention_mask`` (every family has it, ALiBi's included: their biases are built from it)
and ``position_ids`` (not gemma2, bloom, mpt), and ``past_key_values.N.key`` and ``.value``
per layer, ``[batch, kv heads, past, 8]``; bloom, mpt, falcon and gpt_bigcode put the cache
before the mask.

``reference.json``: the eos, the vocabulary, the number of new tokens, and per family the
seed, the export's input names and, per prompt of make_decoders' PROMPTS, the prompt's ids,
Hugging Face's greedy ``generate(do_sample=False, max_new_tokens=NEW_TOKENS)`` tokens, their
decoded text (``skip_special_tokens``) and the smallest gap between the best and
second-best logit on that path. A gap below MIN_GAP (greedy ill-defined) or a path of fewer
than MIN_DISTINCT distinct tokens stops the script: change the family's seed (SEEDS).

Everything is seeded; the references are PyTorch's on its AVX2 kernels with two threads, and
the script runs itself again with ``PYTHONHASHSEED=0`` (set order in the export), so a rerun
with the same pins writes the same files.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from make_decoders import PROMPTS  # this script's folder
from make_real_models import _reexec_with_fixed_hash_seed
from optimum_export import export_kept, greedy, pin_environment, signature

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "tests" / "fixtures" / "real" / "families"
TOKENIZER = REPO_ROOT / "tests" / "fixtures" / "real" / "decoders" / "gpt2" / "tokenizer.json"
KEEP = tuple((name, name) for name in ("model.onnx", "config.json", "generation_config.json"))
EOS = 0  # <|endoftext|> of make_decoders' tokenizer
VOCAB = 384
NEW_TOKENS = 16
MIN_GAP = 1e-3
MIN_DISTINCT = 6  # one token repeated would not tell a wrong position or cache from a right one
THREADS = 2
INIT = 0.2

# The shape most families name alike (hidden_size, ...): width 32, 2 layers, 4 heads of 8.
COMMON = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 64,
    "initializer_range": INIT,
}
GROUPED = {**COMMON, "num_key_value_heads": 2}
TIED = {"tie_word_embeddings": True}  # the head is the embedding: 48 KiB less a file
# AutoConfig.for_model's arguments per family, in each family's own names.
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen2": {**GROUPED, **TIED},
    "phi3": {**GROUPED, **TIED, "original_max_position_embeddings": 64},
    "gemma2": {
        **GROUPED,
        "head_dim": 8,
        "query_pre_attn_scalar": 8,
        "sliding_window": 16,
        "tie_word_embeddings": False,  # tied, a random one repeats the prompt's last token
    },
    "bloom": {
        "hidden_size": 32,  # its MLP is 4 * hidden
        "n_layer": 2,
        "n_head": 4,
        "initializer_range": 1.0,  # at 0.2 its (tied) head repeats one token
    },
    "mpt": {
        "d_model": 32,
        "expansion_ratio": 2,
        "n_layers": 2,
        "n_heads": 4,
        "max_seq_len": 64,
        "initializer_range": INIT,
    },
    "falcon": {
        **{k: v for k, v in COMMON.items() if k != "intermediate_size"},
        "ffn_hidden_size": 64,
        "multi_query": True,
        "new_decoder_architecture": False,
        "parallel_attn": True,
    },
    "gpt_neox": {**COMMON, **TIED},
    "opt": {
        **{k: v for k, v in COMMON.items() if k not in ("intermediate_size", "initializer_range")},
        "word_embed_proj_dim": 32,
        "ffn_dim": 64,
        "init_std": INIT,
    },
    "gpt_bigcode": {
        "n_embd": 32,
        "n_inner": 64,
        "n_layer": 2,
        "n_head": 4,
        "n_positions": 64,
        "multi_query": True,
        "initializer_range": INIT,
    },
    "stablelm": {**GROUPED, **TIED, "use_qkv_bias": True},
    "qwen3": {**GROUPED, **TIED, "head_dim": 8},
    "granite": {  # untied: tied, the scaled embedding makes its random head repeat a token
        **GROUPED,
        "embedding_multiplier": 4.0,
        "residual_multiplier": 0.5,
        "attention_multiplier": 0.125,  # 1 / head_dim, not 1 / sqrt(head_dim)
        "logits_scaling": 2.0,
    },
}
# A family's seed where 0 left a near-tie or too few distinct tokens on a greedy path.
SEEDS = {
    "qwen2": 1,
    "phi3": 3,
    "bloom": 1,
    "mpt": 7,
    "falcon": 2,
    "gpt_neox": 12,
    "opt": 6,
    "gpt_bigcode": 1,
    "stablelm": 1,
}

pin_environment()


def build(family: str) -> Any:
    """The seeded random model of `family`, in eval mode."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(SEEDS.get(family, 0))
    config = AutoConfig.for_model(
        family,
        vocab_size=VOCAB,
        bos_token_id=EOS,
        eos_token_id=EOS,
        pad_token_id=EOS,
        **FAMILIES[family],
    )
    auto: Any = AutoModelForCausalLM  # from_config is not annotated
    return auto.from_config(config).eval()


def make(family: str, tokenizer: Any, out: Path) -> dict[str, Any]:
    """`out/family/`: the family's seeded model exported; its reference entry."""
    model = build(family)
    export_kept(model.save_pretrained, "text-generation-with-past", out / family, KEEP)
    inputs = [spec["name"] for spec in signature(out / family / "model.onnx")["inputs"]]
    cases = []
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt).ids
        tokens, gap = greedy(model, ids, NEW_TOKENS)
        if gap < MIN_GAP:
            raise SystemExit(f"{family}: {prompt!r} has a near-tie ({gap:.2e}): change its seed")
        if len(set(tokens)) < MIN_DISTINCT:
            raise SystemExit(f"{family}: {prompt!r} gives {tokens}: change its seed")
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        cases.append({"prompt": prompt, "ids": ids, "greedy": tokens, "text": text, "gap": gap})
    size = (out / family / "model.onnx").stat().st_size
    print(f"{family}: {size} bytes, {inputs[:3]}, min gap {min(c['gap'] for c in cases):.3f}")
    return {"seed": SEEDS.get(family, 0), "inputs": inputs, "cases": cases}


def main() -> None:
    import torch
    from tokenizers import Tokenizer

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    out: Path = parser.parse_args().out
    torch.set_num_threads(THREADS)
    tokenizer = Tokenizer.from_file(str(TOKENIZER))
    assert tokenizer.token_to_id("<|endoftext|>") == EOS and tokenizer.get_vocab_size() == VOCAB
    reference: dict[str, Any] = {"eos": EOS, "vocab": VOCAB, "new_tokens": NEW_TOKENS}
    reference["families"] = {family: make(family, tokenizer, out) for family in FAMILIES}
    text = json.dumps(reference, indent=1, ensure_ascii=False) + "\n"
    (out / "reference.json").write_text(text, encoding="utf-8")
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"{out}: {total} bytes in all")


if __name__ == "__main__":
    _reexec_with_fixed_hash_seed()
    main()
