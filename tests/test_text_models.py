"""Encoder models that take text: a `prompt` tokenized by the version's `tokenizer.json`.

The fixtures (`tests/fixtures/real/text`, from `scripts/make_text_models.py`) are optimum's
`text-classification` export of a seeded BERT, its `token-classification` export of a seeded
DistilBERT and its sentence-transformers export of a seeded BERT embedder, each with the
tokenizer files `save_pretrained` wrote, and the framework's outputs (Hugging Face's logits,
`SentenceTransformer.encode`'s embeddings): each text alone, and all of them as one padded
batch.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.client import AgentClient, AgentError
from agent.demo.broker import EmbeddedBroker
from agent.service.agent import Agent
from tests.test_batching import batches_run

pytest.importorskip("tokenizers")

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "real" / "text"
REFERENCE: dict[str, Any] = json.loads((FIXTURES / "reference.json").read_text(encoding="utf-8"))
BERT, TOKENS = REFERENCE["models"]["bert_classifier"], REFERENCE["models"]["distilbert_tokens"]
EMBEDDER = REFERENCE["models"]["bert_embedder"]
RERANKER = REFERENCE["models"]["bert_reranker"]
QUERIES = [case["query"] for case in RERANKER["cases"]]
PASSAGES = [case["passage"] for case in RERANKER["cases"]]
TEXTS = [case["text"] for case in BERT["cases"]]
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}

AGGREGATIONS = ("none", "first", "average", "max")  # the pipeline's strategies besides "simple"
ENTITIES = '[[postprocess]]\noutput = "logits"\nop = "entities"\nlabels = "config.json"\n'
# Requests queued within 0.3 s share a run: texts of different lengths padded to join it.
BATCHING = "[batching]\nmax_batch = 8\nmax_queue_delay_us = 300000\n"
POOL = '[[postprocess]]\noutput = "last_hidden_state"\nop = "pool"\n{}'
MODELS = {  # name: (fixture folder, config.toml, files left out)
    "bert": ("bert_classifier", "", ()),
    "tokens": ("distilbert_tokens", "", ()),
    "embedder": ("bert_embedder", "", ()),
    "labelled": (
        "bert_classifier",
        '[[postprocess]]\noutput = "logits"\nop = "softmax"\n'
        '[[postprocess]]\noutput = "logits"\nop = "topk"\nk = 2\nlabels = "config.json"\n',
        (),
    ),
    "sliced": ("bert_classifier", '[stream]\nmode = "batch"\nmicro_batch = 2\n', ()),
    "untokenized": ("bert_classifier", "", ("tokenizer.json",)),
    "mean": ("bert_encoder", POOL.format('method = "mean"\nnormalize = true\n'), ()),
    "cls": ("bert_encoder", POOL.format('method = "cls"\nnormalize = true\n'), ()),
    "cls_sliced": ("bert_encoder", '[stream]\nmode = "batch"\n' + POOL.format(""), ()),
    "reranker": ("bert_reranker", '[[postprocess]]\noutput = "logits"\nop = "sigmoid"\n', ()),
    "ner": ("distilbert_tokens", ENTITIES, ()),
    "bert_batched": ("bert_classifier", BATCHING, ()),
    "tokens_batched": ("distilbert_tokens", BATCHING, ()),
    "ner_batched": ("distilbert_tokens", BATCHING + ENTITIES, ()),
    "mean_batched": (
        "bert_encoder",
        BATCHING + POOL.format('method = "mean"\nnormalize = true\n'),
        (),
    ),
    "ner_sliced": ("distilbert_tokens", '[stream]\nmode = "batch"\n' + ENTITIES, ()),
    "ner_untokenized": ("distilbert_tokens", ENTITIES, ("tokenizer.json",)),
    **{
        f"ner_{strategy}": ("distilbert_tokens", f'{ENTITIES}aggregation = "{strategy}"\n', ())
        for strategy in AGGREGATIONS
    },
}


@pytest.fixture(scope="module")
def text_agent(
    broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Agent, AgentClient]]:
    from tests.conftest import agent_config, serve_agent

    tmp = tmp_path_factory.mktemp("text")
    root = tmp / "models"
    for name, (fixture, config, left_out) in MODELS.items():
        shutil.copytree(
            FIXTURES / fixture, root / name / "1", ignore=shutil.ignore_patterns(*left_out)
        )
        (root / name / "config.toml").write_text(config)
    yield from serve_agent(broker, agent_config(tmp, broker, root))


@pytest.mark.parametrize("case", range(len(TEXTS)))
def test_a_text_gives_the_logits_of_transformers(
    text_agent: tuple[Agent, AgentClient], case: int
) -> None:
    """One text, cut by the version's tokenizer as `transformers` cuts it ([CLS] ... [SEP],
    lower-cased, unknown characters as [UNK]), gives Hugging Face's logits."""
    _, client = text_agent
    want = BERT["cases"][case]
    reply = client.request("bert", {"prompt": want["text"]}, stream=False)
    got = reply.collect()
    np.testing.assert_allclose(got["logits"], [want["logits"]], **TOLERANCE)
    assert reply.timing is not None and reply.timing["tokenize_ms"] >= 0


def test_the_token_ids_themselves_still_go_in(text_agent: tuple[Agent, AgentClient]) -> None:
    _, client = text_agent
    want = BERT["cases"][0]
    ids = np.array([want["ids"]], dtype=np.int64)
    inputs = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": 0 * ids}
    got = client.request("bert", inputs, stream=False).collect()
    np.testing.assert_allclose(got["logits"], [want["logits"]], **TOLERANCE)
    # A negative id: ONNX Runtime's Gather took it from the vocabulary's end, silently.
    ids[0, 1] = -1
    with pytest.raises(AgentError, match="token ids are not negative") as refused:
        client.request("bert", {**inputs, "input_ids": ids}, stream=False).collect()
    assert refused.value.code == "bad_request"


def test_texts_go_as_one_padded_batch(text_agent: tuple[Agent, AgentClient]) -> None:
    """A string tensor of texts is one batch, padded with [PAD] and masked as a pipeline
    pads it: each row's logits are those of the padded batch in `transformers`."""
    _, client = text_agent
    got = client.request("bert", {"prompt": np.array(TEXTS)}, stream=False).collect()
    np.testing.assert_allclose(got["logits"], BERT["batch"], **TOLERANCE)


def test_a_token_classifier_without_token_types(text_agent: tuple[Agent, AgentClient]) -> None:
    """DistilBERT takes no token_type_ids: one row per text, a row of logits per token."""
    _, client = text_agent
    for want in TOKENS["cases"]:
        got = client.request("tokens", {"prompt": want["text"]}, stream=False).collect()
        assert got["logits"].shape == (1, len(want["ids"]), len(TOKENS["labels"]))
        np.testing.assert_allclose(got["logits"], [want["logits"]], **TOLERANCE)
    got = client.request("tokens", {"prompt": np.array(TEXTS)}, stream=False).collect()
    np.testing.assert_allclose(got["logits"], TOKENS["batch"], **TOLERANCE)


def test_sentence_embeddings_are_sentence_transformers(
    text_agent: tuple[Agent, AgentClient],
) -> None:
    """The export pools and normalizes inside the graph: `sentence_embedding` is what
    `SentenceTransformer.encode` gives, for one text and for a padded batch (where the mask
    keeps the padding out of the mean)."""
    _, client = text_agent
    narrow = {"outputs": ["sentence_embedding"]}
    for want in EMBEDDER["cases"]:
        reply = client.request("embedder", {"prompt": want["text"]}, stream=False, params=narrow)
        got = reply.collect()
        assert set(got) == {"sentence_embedding"}
        np.testing.assert_allclose(got["sentence_embedding"], [want["embedding"]], **TOLERANCE)
    batch = client.request("embedder", {"prompt": np.array(TEXTS)}, stream=False, params=narrow)
    got = batch.collect()["sentence_embedding"]
    np.testing.assert_allclose(got, EMBEDDER["batch"], **TOLERANCE)


def test_labels_from_the_exported_config(text_agent: tuple[Agent, AgentClient]) -> None:
    """`labels = "config.json"` reads the id2label that save_pretrained wrote."""
    _, client = text_agent
    got = client.request("labelled", {"prompt": np.array(TEXTS)}, stream=False).collect()
    logits = np.array(BERT["batch"])
    best = np.argsort(-logits, axis=1)[:, :2]
    assert got["logits_indices"].tolist() == best.tolist()
    assert got["logits_labels"].tolist() == [[BERT["labels"][i] for i in row] for row in best]
    soft = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(got["logits"], np.take_along_axis(soft, best, 1), **TOLERANCE)


def test_batch_mode_streams_slices_of_the_texts(text_agent: tuple[Agent, AgentClient]) -> None:
    _, client = text_agent
    chunks = list(client.request("sliced", {"prompt": np.array(TEXTS)}))
    assert [chunk.outputs["logits"].shape for chunk in chunks] == [(2, 3), (2, 3)]
    got = np.concatenate([chunk.outputs["logits"] for chunk in chunks])
    np.testing.assert_allclose(got, BERT["batch"], **TOLERANCE)


@pytest.mark.parametrize(
    ("model", "inputs", "says"),
    [
        ("bert", {"prompt": "word " * 70}, r"is \d+ tokens: the model takes at most 64"),
        ("bert", {"prompt": np.array([], dtype=str)}, r"holds no text"),
        ("bert", {"prompt": np.zeros(3, np.float32)}, r"must be a text, or a string tensor"),
        ("bert", {"prompt": np.array([["a"], ["b"]])}, r"must be a text, or a string tensor"),
        (
            "bert",
            {"prompt": "hello", "input_ids": np.ones((1, 3), np.int64)},
            r"makes input_ids.*not both",
        ),
        ("untokenized", {"prompt": "hello"}, r"needs a tokenizer.json"),
        ("reranker", {"pair": "a passage"}, r"second text of inputs.prompt: send both"),
        ("untokenized", {"pair": "a passage"}, r"inputs.pair \(text\) needs a tokenizer.json"),
        (
            "reranker",
            {"prompt": np.array(["a", "b"]), "pair": np.array(["c", "d", "e"])},
            r"pair holds 3 texts and inputs.prompt 2",
        ),
        ("reranker", {"prompt": "a", "pair": np.zeros(2, np.int64)}, r"inputs.pair must be a"),
        ("reranker", {"prompt": "a", "pair": "word " * 70}, r"prompt and its pair are \d+ tokens"),
    ],
)
def test_bad_text_is_refused_and_the_agent_serves_on(
    text_agent: tuple[Agent, AgentClient], model: str, inputs: dict[str, Any], says: str
) -> None:
    _, client = text_agent
    with pytest.raises(AgentError, match=r"bad_request.*" + says):
        client.request(model, inputs, stream=False).collect()
    got = client.request("bert", {"prompt": TEXTS[0]}, stream=False).collect()
    np.testing.assert_allclose(got["logits"], [BERT["cases"][0]["logits"]], **TOLERANCE)


def test_a_query_and_its_passages_give_the_cross_encoders_scores(
    text_agent: tuple[Agent, AgentClient],
) -> None:
    """`inputs.pair`: each row the prompt and its pair joined by the tokenizer's pair template
    (the passage's token types 1), as `CrossEncoder.predict` joins them: a pair alone, one
    query for several passages, and a batch of pairs padded together give its scores."""
    _, client = text_agent
    for case in RERANKER["cases"]:
        inputs = {"prompt": case["query"], "pair": case["passage"]}
        got = client.request("reranker", inputs, stream=False).collect()
        np.testing.assert_allclose(got["logits"], [[case["score"]]], **TOLERANCE)
    query = RERANKER["cases"][0]["query"]
    passages = np.array([c["passage"] for c in RERANKER["cases"] if c["query"] == query])
    got = client.request("reranker", {"prompt": query, "pair": passages}, stream=False).collect()
    np.testing.assert_allclose(got["logits"][:, 0], RERANKER["batch"][:2], **TOLERANCE)
    inputs = {"prompt": np.array(QUERIES), "pair": np.array(PASSAGES)}
    got = client.request("reranker", inputs, stream=False).collect()
    np.testing.assert_allclose(got["logits"][:, 0], RERANKER["batch"], **TOLERANCE)


def test_pairs_are_cut_as_the_cross_encoders_tokenizer_cuts_them() -> None:
    from agent.models.backends.base import TensorSpec
    from agent.models.text_inputs import open_text_inputs

    names = ("input_ids", "attention_mask", "token_type_ids")
    specs = [TensorSpec(name, np.dtype(np.int64), ("batch", "sequence")) for name in names]
    text = open_text_inputs(specs, FIXTURES / "bert_reranker")
    assert text is not None
    for case in RERANKER["cases"]:
        made, _ = text.inputs(np.array(case["query"]), np.array(case["passage"]))
        assert made["input_ids"].tolist() == [case["ids"]]


def test_the_passage_is_read_not_only_the_query(text_agent: tuple[Agent, AgentClient]) -> None:
    """The fixture's scores differ between a query's passages, and the prompt alone (no pair)
    is another input again: the pair reaches the model."""
    _, client = text_agent
    assert RERANKER["batch"][0] != pytest.approx(RERANKER["batch"][1], abs=1e-3)
    alone = client.request("reranker", {"prompt": QUERIES[0]}, stream=False).collect()
    assert float(alone["logits"][0, 0]) != pytest.approx(RERANKER["batch"][0], abs=1e-3)


def test_ops_that_name_words_take_no_pair(text_agent: tuple[Agent, AgentClient]) -> None:
    _, client = text_agent
    inputs = {"prompt": TEXTS[0], "pair": TEXTS[1]}
    with pytest.raises(AgentError, match=r"model_error.*without inputs.pair"):
        client.request("ner", inputs, stream=False).collect()


def same_entities(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert [{**e, "score": 0} for e in got] == [{**e, "score": 0} for e in want]
    np.testing.assert_allclose([e["score"] for e in got], [e["score"] for e in want], rtol=1e-5)


def test_entities_are_the_pipelines(text_agent: tuple[Agent, AgentClient]) -> None:
    """`op = "entities"`: what `pipeline("token-classification", aggregation_strategy=
    "simple")` gives: tags grouped (B- starts a group), words joined by the tokenizer's
    decoder (an unknown token as its text), characters of the text, mean scores; O left out.
    A batch of texts gives a list each."""
    _, client = text_agent
    for want in TOKENS["cases"]:
        got = client.request("ner", {"prompt": want["text"]}, stream=False).collect()
        assert set(got) == {"entities"} and len(got["entities"]) == 1
        same_entities(got["entities"][0], want["entities"])
    got = client.request("ner", {"prompt": np.array(TEXTS)}, stream=False).collect()
    for row, want in zip(got["entities"], TOKENS["cases"], strict=True):
        same_entities(row, want["entities"])


@pytest.mark.parametrize("strategy", AGGREGATIONS)
def test_entities_of_each_aggregation_strategy_are_the_pipelines(
    text_agent: tuple[Agent, AgentClient], strategy: str
) -> None:
    """`aggregation = "none"`: each token's label, score, index and token; "first",
    "average" and "max": tokens joined into words (a `##` piece continues its word, an unknown
    token starts one) and each word labelled by its first token, its tokens' mean scores or its
    most confident token, then grouped; as the pipeline's `aggregation_strategy` gives them.
    The fixture's texts make the strategies disagree (a word labelled PER by "first" and "max"
    is LOC by "average"; a word left out by "first" is in with "max")."""
    _, client = text_agent
    wants = [case["entities_by"][strategy] for case in TOKENS["cases"]]
    for text, want in zip(TEXTS, wants, strict=True):
        got = client.request(f"ner_{strategy}", {"prompt": text}, stream=False).collect()
        same_entities(got["entities"][0], want)
    got = client.request(f"ner_{strategy}", {"prompt": np.array(TEXTS)}, stream=False).collect()
    for row, want in zip(got["entities"], wants, strict=True):
        same_entities(row, want)


def test_the_strategies_differ_on_the_fixture() -> None:
    """The references above are worth comparing: the strategies' entities are not all one."""
    first, average, maximum = (
        [case["entities_by"][strategy] for case in TOKENS["cases"]]
        for strategy in ("first", "average", "max")
    )
    assert first != average and first != maximum and average != maximum


def test_an_unknown_aggregation_is_refused_at_load() -> None:
    from agent.models.postprocess import PostprocessOp

    with pytest.raises(ValueError, match="aggregation"):
        PostprocessOp(output="logits", op="entities", labels="config.json", aggregation="mean")
    with pytest.raises(ValueError, match="takes no aggregation"):
        PostprocessOp(output="logits", op="softmax", aggregation="first")


def test_entities_need_the_text(text_agent: tuple[Agent, AgentClient]) -> None:
    agent, client = text_agent
    ids = np.array([TOKENS["cases"][0]["ids"]], dtype=np.int64)
    inputs = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    with pytest.raises(AgentError, match=r"model_error.*send inputs.prompt, not token ids"):
        client.request("ner", inputs, stream=False).collect()
    versions = agent.models.inventory()["models"]
    assert 'mode = "whole" only' in versions["ner_sliced"]["versions"]["1"]["error"]
    assert "takes no text" in versions["ner_untokenized"]["versions"]["1"]["error"]


def test_the_inventory_says_which_versions_take_text(
    text_agent: tuple[Agent, AgentClient],
) -> None:
    from agent.models.records import format_inventory

    agent, _ = text_agent
    inventory = agent.models.inventory()
    versions = {name: model["versions"]["1"] for name, model in inventory["models"].items()}
    assert versions["bert"]["text_inputs"] == ["prompt", "pair"]
    assert "text_inputs" not in versions["untokenized"]
    assert "    text in: prompt, pair" in format_inventory(inventory).splitlines()


@pytest.mark.parametrize(("model", "key"), [("mean", "embedding"), ("cls", "cls")])
def test_an_encoders_hidden_states_pooled_on_the_box(
    text_agent: tuple[Agent, AgentClient], model: str, key: str
) -> None:
    """`op = "pool"` on a plain feature-extraction export (`last_hidden_state`): the mean of
    each text's tokens, normalised, is what the sentence-transformers model (mean pooling,
    Normalize) encodes; its first token's, normalised, the [CLS] recipe of BGE's card. In a
    padded batch only each text's own tokens count."""
    _, client = text_agent
    for want in EMBEDDER["cases"]:
        got = client.request(model, {"prompt": want["text"]}, stream=False).collect()
        assert set(got) == {"sentence_embedding"}
        np.testing.assert_allclose(got["sentence_embedding"], [want[key]], **TOLERANCE)
    batch = client.request(model, {"prompt": np.array(TEXTS)}, stream=False).collect()
    want_batch = EMBEDDER["batch"] if key == "embedding" else EMBEDDER["cls_batch"]
    np.testing.assert_allclose(batch["sentence_embedding"], want_batch, **TOLERANCE)
    versions = text_agent[0].models.inventory()["models"]
    assert (
        'postprocess pool: mode = "whole" only' in versions["cls_sliced"]["versions"]["1"]["error"]
    )


@pytest.mark.parametrize(
    ("model", "check"),
    [
        (
            "bert_batched",
            lambda got, k: np.testing.assert_allclose(
                got["logits"], [BERT["cases"][k]["logits"]], **TOLERANCE
            ),
        ),
        (
            "tokens_batched",
            lambda got, k: np.testing.assert_allclose(
                got["logits"], [TOKENS["cases"][k]["logits"]], **TOLERANCE
            ),
        ),
        (
            "ner_batched",
            lambda got, k: same_entities(got["entities"][0], TOKENS["cases"][k]["entities"]),
        ),
        (
            "mean_batched",
            lambda got, k: np.testing.assert_allclose(
                got["sentence_embedding"], [EMBEDDER["cases"][k]["embedding"]], **TOLERANCE
            ),
        ),
    ],
)
def test_requests_of_different_lengths_share_a_run(
    text_agent: tuple[Agent, AgentClient], model: str, check: Any
) -> None:
    """`[batching]`: one text a request, of 3 to 17 tokens, queued together: padded to the
    longest they run as one batch, and each answer is the text's alone (its per-token logits
    and entities cut back to its own tokens, its pooling over its own)."""
    agent, client = text_agent
    lengths = {len(case["ids"]) for case in TOKENS["cases"]}
    assert len(lengths) == len(TEXTS)  # every text a length of its own
    before = batches_run(agent, model)
    replies = [client.request(model, {"prompt": text}, stream=False) for text in TEXTS]
    for k, reply in enumerate(replies):
        check(reply.collect(), k)
    runs, requests = (a - b for a, b in zip(batches_run(agent, model), before, strict=True))
    assert requests == len(TEXTS) and runs < len(TEXTS)  # they shared runs
