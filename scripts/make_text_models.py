#!/usr/bin/env python3
"""Dev-only: regenerate ``tests/fixtures/real/text/`` (encoder models that take text).

Not run by CI. Needs the export stack of ``scripts/make_real_models.py`` (torch,
transformers, optimum-onnx, tokenizers) in ``.venv-export``::

    .venv-export/bin/python scripts/make_text_models.py [--out tests/fixtures/real/text]

It writes, each folder a version folder as ``save_pretrained`` and optimum leave it
(``model.onnx``, ``config.json`` with ``id2label``, ``tokenizer.json``,
``tokenizer_config.json``, ``special_tokens_map.json``, ``vocab.txt``):

- ``bert_classifier/``: a seeded random BERT sequence classifier (3 labels), exported with
  optimum's ``text-classification`` task: ``input_ids``, ``attention_mask``,
  ``token_type_ids`` in, ``logits [batch, 3]`` out;
- ``distilbert_tokens/``: a seeded random DistilBERT token classifier (5 labels), exported
  with optimum's ``token-classification`` task: no ``token_type_ids``, ``logits
  [batch, sequence, 5]`` out;
- ``bert_embedder/``: a seeded random BERT as a sentence-transformers model (mean pooling,
  then normalized), exported with optimum's ``feature-extraction`` task for the
  ``sentence_transformers`` library: ``input_ids``, ``attention_mask`` in,
  ``token_embeddings`` and ``sentence_embedding [batch, 32]`` out (needs
  ``sentence-transformers`` in the export venv);
- ``bert_encoder/``: that embedder's BERT alone, exported with optimum's
  ``feature-extraction`` task for the ``transformers`` library: ``last_hidden_state``, the
  pooling left to the user (the agent's ``pool`` op);
- ``bert_reranker/``: a seeded random sentence-transformers cross-encoder (a BERT sequence
  classifier of one label) exported with optimum's ``text-classification`` task: a query and
  a passage in as one row (``[CLS] query [SEP] passage [SEP]``), ``logits [batch, 1]`` out;
- ``reference.json``: per model, each text's token ids and the framework's output for it alone
  (``AutoTokenizer`` then the PyTorch model's logits; ``SentenceTransformer.encode``'s
  embedding, and the [CLS] token's normalised hidden state; for the token classifier also the
  entities of ``pipeline("token-classification", aggregation_strategy="simple")``, and in
  ``entities_by`` those of its other strategies; for the reranker, each pair's ids and
  ``CrossEncoder.predict``'s score), and the
  outputs of all texts as one padded batch, as a pipeline makes them.

The tokenizer is a lower-casing WordPiece made with `tokenizers` from the text below (BERT's
normalizer, pre-tokenizer and ``[CLS] $A [SEP]`` template; ``build_tokenizer``). Everything is
seeded, so a rerun with the same pins writes the same numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "tests" / "fixtures" / "real" / "text"
MAX_POSITIONS = 64
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = 60  # whole words in the vocabulary besides the characters
TEXTS = [
    "The little robot woke up happy.",
    "Edge boxes stream results to their backends over MQTT",
    "Café naïve 日本語 🙂",
    "bad",
]
MODELS = {
    "bert_classifier": ("text-classification", ["negative", "neutral", "positive"]),
    "distilbert_tokens": ("token-classification", ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]),
}
# The token classification pipeline's other aggregation strategies ("simple" is `entities`).
AGGREGATIONS = ("none", "first", "average", "max")
EMBEDDER = "bert_embedder"
RERANKER = "bert_reranker"  # a cross-encoder: a query and a passage in, one score out
PAIRS = [  # (query, passage) for the reranker: two queries, each against two passages
    ("where did alice fly", "Alice flew from Paris to Berlin, and Bob drove from Zurich."),
    ("where did alice fly", "The weather was bad and the train was late."),
    ("is the coffee good", "the coffee was good and the people were kind"),
    ("is the coffee good", "Edge boxes stream results to their backends over MQTT"),
]
ENCODER = "bert_encoder"  # the embedder's BERT alone: last_hidden_state, no pooling
BERT = {  # the BERTs' size: two layers of width 32
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": MAX_POSITIONS,
    "initializer_range": 0.2,
}

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Before torch loads: its own and oneDNN's AVX2 kernels, as the committed references were made
# (AVX-512 kernels move the logits' last digits, and with them the files' bytes).
os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
os.environ.setdefault("DNNL_MAX_CPU_ISA", "AVX2")

CORPUS = """\
The little robot woke up in the morning and looked at the sky. It was blue and bright.
Edge boxes stream results to their backends over MQTT, one chunk at a time, and keep a spool.
A classifier reads a sentence and says whether it is positive, neutral or negative.
Operators drop a new model into the folder and the agent swaps to it without a pause.
Alice flew from Paris to Berlin, and Bob drove from Zurich to Milan on Monday.
The weather was bad, the train was late, but the coffee was good and the people were kind.
"""


def build_tokenizer() -> Any:
    """A lower-casing WordPiece with BERT's pieces (`tokenizers.Tokenizer`).

    Its vocabulary is made here, not by `WordPieceTrainer`, whose ties fall differently from
    one run to the next: the special tokens, every character of the corpus as a word start and
    as a ``##`` continuation, then its most frequent words (ties in alphabetical order). The
    corpus is cut by the tokenizer's own normalizer and pre-tokenizer.
    """
    from collections import Counter

    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    normalizer = normalizers.BertNormalizer(lowercase=True)
    pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    words = [w for w, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(CORPUS))]
    chars = sorted({c for word in words for c in word})
    frequent = sorted(Counter(w for w in words if len(w) > 1).items(), key=lambda i: (-i[1], i[0]))
    tokens = [*SPECIALS, *chars, *(f"##{c}" for c in chars), *(w for w, _ in frequent[:WORDS])]
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    return tokenizer


def wrapped(name: str, tokenizer: Any) -> Any:
    """`tokenizer` as the model's own fast tokenizer class (DistilBERT's makes no
    `token_type_ids`)."""
    from transformers import BertTokenizerFast, DistilBertTokenizerFast

    kind = BertTokenizerFast if name == "bert_classifier" else DistilBertTokenizerFast
    return kind(tokenizer_object=tokenizer, model_max_length=MAX_POSITIONS)


def build(name: str, vocab: int, labels: list[str]) -> Any:
    import torch
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        DistilBertConfig,
        DistilBertForTokenClassification,
    )

    torch.manual_seed(0)
    id2label = dict(enumerate(labels))
    label2id = {label: i for i, label in id2label.items()}
    common = {"vocab_size": vocab, "id2label": id2label, "label2id": label2id, "pad_token_id": 0}
    if name == "bert_classifier":
        return BertForSequenceClassification(BertConfig(**BERT, **common)).eval()
    config = DistilBertConfig(
        dim=32,
        n_layers=2,
        n_heads=2,
        hidden_dim=64,
        max_position_embeddings=MAX_POSITIONS,
        initializer_range=0.2,
        **common,
    )
    return DistilBertForTokenClassification(config).eval()


def export(model: Any, tokenizer: Any, task: str, dst: Path) -> None:
    """`dst`: optimum's export of `model` for `task`, with the files `save_pretrained` wrote."""
    from optimum.exporters.onnx import main_export

    with tempfile.TemporaryDirectory(prefix="text-export-") as tmp:
        src, onnx_dir = Path(tmp) / "hf", Path(tmp) / "onnx"
        model.save_pretrained(src)
        tokenizer.save_pretrained(src)
        main_export(str(src), output=str(onnx_dir), task=task, device="cpu")
        copy_export(onnx_dir, dst)


def copy_export(onnx_dir: Path, dst: Path) -> None:
    """`dst` made anew with what optimum wrote: the model, the JSON files, the vocabulary."""
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for file in sorted(onnx_dir.iterdir()):
        if file.suffix in (".onnx", ".json", ".txt"):
            shutil.copy(file, dst / file.name)


def logits(model: Any, tokenizer: Any, texts: list[str]) -> list[Any]:
    """Hugging Face's logits of `texts` as one batch (padded to the longest)."""
    import torch

    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        result: list[Any] = model(**batch).logits.tolist()
    return result


def make(name: str, tokenizer: Any, out: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    task, labels = MODELS[name]
    tokenizer = wrapped(name, tokenizer)
    model = build(name, len(tokenizer), labels)
    export(model, tokenizer, task, out / name)
    saved = AutoTokenizer.from_pretrained(out / name)  # what a user's pipeline would load
    cases = []
    for text in TEXTS:
        ids = saved(text)["input_ids"]
        cases.append({"text": text, "ids": ids, "logits": logits(model, saved, [text])[0]})
        if task == "token-classification":
            cases[-1]["entities"] = entities(model, saved, text, "simple")
            cases[-1]["entities_by"] = {
                strategy: entities(model, saved, text, strategy) for strategy in AGGREGATIONS
            }
        print(f"{name}: {text!r} -> {ids}")
    return {"task": task, "labels": labels, "cases": cases, "batch": logits(model, saved, TEXTS)}


def entities(model: Any, tokenizer: Any, text: str, strategy: str) -> list[dict[str, Any]]:
    """`pipeline("token-classification", aggregation_strategy=strategy)`'s entities."""
    from transformers import pipeline

    found = pipeline(
        "token-classification", model=model, tokenizer=tokenizer, aggregation_strategy=strategy
    )(text)
    return [{**entity, "score": float(entity["score"])} for entity in found]


def make_embedder(tokenizer: Any, out: Path) -> dict[str, Any]:
    """`out/bert_embedder/`: a sentence-transformers model (BERT, mean pooling, normalized)
    exported by optimum; SentenceTransformer's own embeddings as the reference."""
    import torch
    from optimum.exporters.onnx import main_export
    from sentence_transformers import SentenceTransformer
    from sentence_transformers import models as st_models
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    wrapper = wrapped("bert_classifier", tokenizer)
    config = BertConfig(vocab_size=len(wrapper), pad_token_id=0, **BERT)
    with tempfile.TemporaryDirectory(prefix="embedder-export-") as tmp:
        bert, st_dir, onnx_dir = Path(tmp) / "bert", Path(tmp) / "st", Path(tmp) / "onnx"
        BertModel(config).eval().save_pretrained(bert)
        wrapper.save_pretrained(bert)
        encoder = st_models.Transformer(str(bert), max_seq_length=MAX_POSITIONS)
        pooling = st_models.Pooling(encoder.get_word_embedding_dimension(), "mean")
        model = SentenceTransformer(modules=[encoder, pooling, st_models.Normalize()], device="cpu")
        model.save(str(st_dir))
        main_export(
            str(st_dir),
            output=str(onnx_dir),
            task="feature-extraction",
            library_name="sentence_transformers",
            device="cpu",
        )
        copy_export(onnx_dir, out / EMBEDDER)
        main_export(
            str(bert),
            output=str(Path(tmp) / "plain"),
            task="feature-extraction",
            library_name="transformers",
            device="cpu",
        )
        copy_export(Path(tmp) / "plain", out / ENCODER)
    cases = []
    for text in TEXTS:
        ids = model.tokenizer(text)["input_ids"]
        cases.append(
            {
                "text": text,
                "ids": ids,
                "embedding": model.encode(text).tolist(),
                "cls": cls_embeddings(model, [text])[0],
            }
        )
        print(f"{EMBEDDER}: {text!r} -> {ids}")
    batch = model.encode(TEXTS, batch_size=len(TEXTS)).tolist()
    return {
        "task": "feature-extraction",
        "cases": cases,
        "batch": batch,
        "cls_batch": cls_embeddings(model, TEXTS),
    }


def make_reranker(tokenizer: Any, out: Path) -> dict[str, Any]:
    """`out/bert_reranker/`: a sentence-transformers cross-encoder (a BERT sequence classifier
    of one label over a query and a passage) exported by optimum's `text-classification` task;
    `CrossEncoder.predict`'s scores (the logit's sigmoid) as the reference, of each pair alone
    and of all as one padded batch, with the logits of `tokenizer(queries, passages)`."""
    import torch
    from sentence_transformers import CrossEncoder
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(1)
    wrapper = wrapped("bert_classifier", tokenizer)
    config = BertConfig(vocab_size=len(wrapper), pad_token_id=0, num_labels=1, **BERT)
    model = BertForSequenceClassification(config).eval()
    export(model, wrapper, "text-classification", out / RERANKER)
    with tempfile.TemporaryDirectory(prefix="reranker-") as tmp:
        model.save_pretrained(tmp)
        wrapper.save_pretrained(tmp)
        encoder = CrossEncoder(tmp, max_length=MAX_POSITIONS, device="cpu")
        batch_scores = encoder.predict(PAIRS, batch_size=len(PAIRS)).tolist()
        cases = [
            {
                "query": query,
                "passage": passage,
                "ids": encoder.tokenizer(query, passage)["input_ids"],
                "score": float(encoder.predict([(query, passage)])[0]),
            }
            for query, passage in PAIRS
        ]
    batch = wrapper([q for q, _ in PAIRS], [p for _, p in PAIRS], padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits.tolist()
    for case in cases:
        print(f"{RERANKER}: {case['query']!r} / {case['passage']!r} -> {case['score']:.4f}")
    return {"task": "text-classification", "cases": cases, "batch": batch_scores, "logits": logits}


def cls_embeddings(model: Any, texts: list[str]) -> list[Any]:
    """The [CLS] token's last hidden state, L2-normalised (BGE's model-card recipe), of
    `texts` as one padded batch, from the sentence-transformers model's own BERT."""
    import torch

    bert, tokenizer = model[0].auto_model, model.tokenizer
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        first = bert(**batch).last_hidden_state[:, 0]
    result: list[Any] = torch.nn.functional.normalize(first, p=2, dim=1).tolist()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    out: Path = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    reference = {"max_positions": MAX_POSITIONS, "models": {}}
    for name in MODELS:
        reference["models"][name] = make(name, tokenizer, out)
    reference["models"][EMBEDDER] = make_embedder(tokenizer, out)
    reference["models"][RERANKER] = make_reranker(tokenizer, out)
    text = json.dumps(reference, indent=1, ensure_ascii=False)
    (out / "reference.json").write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
