"""How a version's tokenizer makes texts into its inputs (`agent.models.text_inputs`), and
labels read from a `config.json` (`agent.models.postprocess`), without a broker."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.models.backends.base import ModelLoadError, TensorSpec
from agent.models.postprocess import PostprocessOp, build_postprocess
from agent.models.text_inputs import TextRefused, open_text_inputs
from tests.models_helpers import hide_module

pytest.importorskip("tokenizers")

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "a", "b", "c"]


def tokenizer_folder(tmp_path: Path, **files: dict[str, Any]) -> Path:
    """A folder with a word-level `tokenizer.json` ([CLS] $A [SEP]) and the JSON `files`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    for name, data in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    return tmp_path


def specs(*names: str, length: int | str = "sequence", dtype: Any = np.int64) -> list[TensorSpec]:
    return [TensorSpec(name, np.dtype(dtype), ("batch", length)) for name in names]


def test_rows_are_padded_right_and_masked(tmp_path: Path) -> None:
    text = open_text_inputs(specs("input_ids", "attention_mask"), tokenizer_folder(tmp_path))
    assert text is not None
    made, _ = text.inputs(np.array(["a b c", "b"]))
    assert made["input_ids"].tolist() == [[2, 4, 5, 6, 3], [2, 5, 3, 0, 0]]
    assert made["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert made["input_ids"].dtype == np.int64


def test_the_tokenizers_pad_token_and_side(tmp_path: Path) -> None:
    """`tokenizer_config.json`'s pad token (an AddedToken's fields, as older files write it)
    and `padding_side = "left"`, as a decoder's tokenizer is saved."""
    folder = tokenizer_folder(
        tmp_path, tokenizer_config={"pad_token": {"content": "c"}, "padding_side": "left"}
    )
    text = open_text_inputs(specs("input_ids", "attention_mask"), folder)
    assert text is not None
    made, _ = text.inputs(np.array(["a b", "a"]))
    assert made["input_ids"].tolist() == [[2, 4, 5, 3], [6, 2, 4, 3]]
    assert made["attention_mask"].tolist() == [[1, 1, 1, 1], [0, 1, 1, 1]]


def test_the_pad_id_of_config_json_without_a_pad_token(tmp_path: Path) -> None:
    folder = tokenizer_folder(tmp_path, config={"pad_token_id": 1})
    text = open_text_inputs(specs("input_ids"), folder)
    assert text is not None
    assert text.inputs(np.array(["a b", "a"]))[0]["input_ids"].tolist() == [
        [2, 4, 5, 3],
        [2, 4, 3, 1],
    ]


def test_a_fixed_sequence_is_filled_and_bounds_the_text(tmp_path: Path) -> None:
    """A static export (`input_ids [1, 6]`, int32, positions as inputs): every row is padded
    to 6, a longer text is refused, not cut."""
    names = ("input_ids", "token_type_ids", "position_ids")
    text = open_text_inputs(specs(*names, length=6, dtype=np.int32), tokenizer_folder(tmp_path))
    assert text is not None
    made, _ = text.inputs(np.array("a b"))
    assert made["input_ids"].tolist() == [[2, 4, 5, 3, 0, 0]]
    assert made["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5]]
    assert made["token_type_ids"].tolist() == [[0] * 6]
    assert {a.dtype for a in made.values()} == {np.dtype(np.int32)}
    with pytest.raises(TextRefused, match="is 7 tokens: the model takes at most 6"):
        text.inputs(np.array("a b c a b"))


def test_the_context_of_config_json_bounds_the_text(tmp_path: Path) -> None:
    text = open_text_inputs(
        specs("input_ids"), tokenizer_folder(tmp_path, config={"max_position_embeddings": 4})
    )
    assert text is not None
    assert text.inputs(np.array("a b"))[0]["input_ids"].shape == (1, 4)
    with pytest.raises(TextRefused, match="is 5 tokens: the model takes at most 4"):
        text.inputs(np.array("a b c"))


@pytest.mark.parametrize(
    "inputs",
    [
        specs("input_ids", dtype=np.float32),  # not token ids
        specs("input_ids", "prompt"),  # the model's own input of that name
        specs("pixel_values"),
    ],
)
def test_models_that_take_no_text(tmp_path: Path, inputs: list[TensorSpec]) -> None:
    assert open_text_inputs(inputs, tokenizer_folder(tmp_path)) is None


def test_no_tokenizer_json_no_text(tmp_path: Path) -> None:
    assert open_text_inputs(specs("input_ids"), tmp_path) is None


def test_without_the_library_the_model_takes_token_ids(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A folder that served token ids before text came in still loads without the extra."""
    folder = tokenizer_folder(tmp_path)
    hide_module(monkeypatch, "tokenizers")
    assert open_text_inputs(specs("input_ids"), folder) is None
    assert "install the 'text' extra" in caplog.text


def test_a_tokenizer_beside_token_ids_of_another_rank(tmp_path: Path) -> None:
    ids = [TensorSpec("input_ids", np.dtype(np.int64), ("batch", "choices", "sequence"))]
    with pytest.raises(ModelLoadError, match=r"input_ids is \['batch', 'choices', 'sequence'\]"):
        open_text_inputs(ids, tokenizer_folder(tmp_path))


def test_a_broken_tokenizer_json_fails_the_version(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json cannot be read"):
        open_text_inputs(specs("input_ids"), tmp_path)


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (np.array(["a", 3], dtype=object), "must hold texts"),
        (np.array(["a"] * 1025), "holds 1025 texts: at most 1024"),
        (np.array(3), "must be a text"),
    ],
)
def test_what_is_not_text(tmp_path: Path, value: Any, says: str) -> None:
    text = open_text_inputs(specs("input_ids"), tokenizer_folder(tmp_path))
    assert text is not None
    with pytest.raises(TextRefused, match=says):
        text.inputs(value)


def topk_of_config(folder: Path) -> Any:
    op = PostprocessOp(output="logits", op="topk", k=2, labels="config.json")
    return build_postprocess([op], ["logits"], folder)


def test_labels_from_id2label(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"id2label": {"1": "yes", "0": "no"}}))
    post = topk_of_config(tmp_path)
    assert post is not None
    got = post.apply({"logits": np.array([[0.1, 0.9]], np.float32)})
    assert got["logits_labels"].tolist() == [["yes", "no"]]


@pytest.mark.parametrize(
    ("config", "says"),
    [
        ({}, r"config\.json has no id2label"),
        ({"id2label": {"0": "no", "2": "yes"}}, "must name the classes 0 to 1"),
        ({"id2label": {"x": "no"}}, "a key that is not an id"),
        ({"id2label": {"0": 5}}, "must name the classes 0 to 0"),
    ],
)
def test_an_id2label_that_cannot_label(tmp_path: Path, config: Any, says: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=says):
        topk_of_config(tmp_path)


def test_entities_of_left_padded_rows(tmp_path: Path) -> None:
    """Each text's tokens found where its row put them (left padding moves them), its own
    unknown words named by their text, a group per tag run, `B-` starting a new one."""
    from agent.models.entities import EntitiesSpec, decode_entities

    folder = tokenizer_folder(tmp_path, tokenizer_config={"padding_side": "left"})
    text = open_text_inputs(specs("input_ids"), folder)
    assert text is not None
    made, batch = text.inputs(np.array(["a b zz c", "c"]))
    assert made["input_ids"].tolist() == [[2, 4, 5, 1, 6, 3], [0, 0, 0, 2, 6, 3]]
    labels = ("O", "B-X", "I-X")
    best = [[0, 1, 2, 2, 1, 0], [0, 0, 0, 0, 2, 0]]  # a row's best label a position
    logits = np.eye(3, dtype=np.float32)[best] * 4
    got = decode_entities(EntitiesSpec("logits", labels), {"logits": logits}, batch)
    assert [
        [(e["entity_group"], e["word"], e["start"], e["end"]) for e in row]
        for row in got["entities"]
    ] == [
        [("X", "a b zz", 0, 6), ("X", "c", 7, 8)],
        [("X", "c", 0, 1)],
    ]


@pytest.mark.parametrize(
    ("strategy", "want"),
    [
        ("simple", [("X", "a", 0, 1), ("X", "b", 2, 3), ("X", "c", 4, 5)]),
        ("first", [("X", "a - b", 0, 3), ("X", "c", 4, 5)]),
        ("average", [("X", "c", 4, 5)]),  # a-b: O by the mean of its three tokens
        ("max", [("X", "c", 4, 5)]),  # a-b: O, its most confident token's
    ],
)
def test_words_of_a_tokenizer_that_does_not_mark_pieces(
    tmp_path: Path, strategy: Any, want: list[tuple[str, str, int, int]]
) -> None:
    """A tokenizer with no `##` (a word-level one here, byte-level BPE alike) gets the
    pipeline's fallback: a token with no space at or just before it continues the word, so
    "a-b" is one word of three tokens and "c" another."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from agent.models.entities import EntitiesSpec, decode_entities

    vocab = {w: i for i, w in enumerate([*WORDS, "-"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    text = open_text_inputs(specs("input_ids"), tmp_path)
    assert text is not None
    made, batch = text.inputs(np.array(["a-b c"]))
    assert made["input_ids"].tolist() == [[2, 4, 7, 5, 6, 3]]
    # [CLS], a: B-X (0.79), -: O (0.91), b: I-X (0.79), c: B-X, [SEP]
    logits = np.array([[[0, 0, 0], [0, 2, 0], [3, 0, 0], [0, 0, 2], [0, 2, 0], [0, 0, 0]]])
    spec = EntitiesSpec("logits", ("O", "B-X", "I-X"), strategy)
    got = decode_entities(spec, {"logits": logits.astype(np.float32)}, batch)
    found = got["entities"][0]
    assert [(e["entity_group"], e["word"], e["start"], e["end"]) for e in found] == want


def test_pairs_are_joined_by_the_pair_template(tmp_path: Path) -> None:
    """`pair`: each row `[CLS] prompt [SEP] pair [SEP]`, the pair's token types 1 (the
    template's), padded as one batch; one prompt goes with every pair."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)],
    )
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    text = open_text_inputs(specs("input_ids", "attention_mask", "token_type_ids"), tmp_path)
    assert text is not None
    made, batch = text.inputs(np.array("a"), np.array(["b c", "c"]))
    assert made["input_ids"].tolist() == [[2, 4, 3, 5, 6, 3], [2, 4, 3, 6, 3, 0]]
    assert made["token_type_ids"].tolist() == [[0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 0]]
    assert made["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]]
    assert batch.texts == ("a", "a") and batch.pairs == ("b c", "c")
    with pytest.raises(TextRefused, match=r"pair holds 2 texts and inputs\.prompt 3"):
        text.inputs(np.array(["a", "b", "c"]), np.array(["b", "c"]))


@pytest.mark.parametrize(
    ("ids_length", "outputs", "want"),
    [
        ("sequence", {"logits": ("batch", 3)}, frozenset()),
        ("sequence", {"logits": ("batch", "sequence", 5)}, frozenset({"logits"})),
        ("sequence", {"h": ("batch", "sequence", 8), "p": ("batch", 8)}, frozenset({"h"})),
        ("sequence", {"logits": ("batch", "Addlogits_dim_1")}, None),  # an axis not known
        ("sequence", {"x": ("batch", 4, "sequence")}, None),  # the tokens on another axis
        (6, {"logits": ("batch", 6, 5)}, None),  # a fixed length: every row already 6
    ],
)
def test_which_outputs_carry_the_tokens(ids_length: Any, outputs: Any, want: Any) -> None:
    """Requests of different lengths may share a run only where every output's axes are
    known: the token axis (input_ids' own symbol, on axis 1) is cut back, the rest fixed."""
    from agent.models.text_inputs import token_outputs_of

    (ids,) = specs("input_ids", length=ids_length)
    found = [TensorSpec(name, np.dtype(np.float32), shape) for name, shape in outputs.items()]
    assert token_outputs_of(ids, found) == want


def test_rows_padded_on_the_right_to_join(tmp_path: Path) -> None:
    names = ("input_ids", "attention_mask", "token_type_ids", "position_ids")
    text = open_text_inputs(specs(*names), tokenizer_folder(tmp_path), [])
    assert text is not None and text.joins_lengths
    made, _ = text.inputs(np.array("a b"))
    padded = text.padded({**made, "other": np.ones((1, 2))}, 6)
    assert padded["input_ids"].tolist() == [[2, 4, 5, 3, 0, 0]]
    assert padded["attention_mask"].tolist() == [[1, 1, 1, 1, 0, 0]]
    assert padded["token_type_ids"].tolist() == [[0] * 6]
    assert padded["position_ids"].tolist() == [list(range(6))]
    assert padded["other"].shape == (1, 2)  # not a token input: left as it came
    left = open_text_inputs(
        specs("input_ids"),
        tokenizer_folder(tmp_path, tokenizer_config={"padding_side": "left"}),
        [],
    )
    assert left is not None and not left.joins_lengths  # each text's tokens would move


def test_a_text_too_long_to_fit_is_refused_before_it_is_cut(tmp_path: Path) -> None:
    """More characters than the model's tokens can hold (100 a token) is refused without
    tokenizing (seconds of a worker for the 4 MB a request may carry); a long unknown word,
    one token, is not."""
    folder = tokenizer_folder(tmp_path, config={"max_position_embeddings": 4})
    text = open_text_inputs(specs("input_ids"), folder)
    assert text is not None
    assert text.inputs(np.array("x" * 400))[0]["input_ids"].tolist() == [[2, 1, 3]]
    with pytest.raises(TextRefused, match=r"is 401 characters: more than 4 tokens hold"):
        text.inputs(np.array(["a", "x" * 401]))


def test_pooling_left_padded_rows(tmp_path: Path) -> None:
    """Each text's own tokens pooled, wherever its padding put them; not normalised unless
    asked; a request of token ids has no text to pool over."""
    from agent.models.pooling import PoolSpec, pool_texts

    folder = tokenizer_folder(tmp_path, tokenizer_config={"padding_side": "left"})
    text = open_text_inputs(specs("input_ids"), folder)
    assert text is not None
    _, batch = text.inputs(np.array(["a b", "c"]))  # [[2, 4, 5, 3], [0, 2, 6, 3]]
    hidden = np.arange(16, dtype=np.float32).reshape(2, 4, 2)
    mean = pool_texts(PoolSpec("h", "mean", False), {"h": hidden}, batch)
    assert mean["sentence_embedding"].tolist() == [[3.0, 4.0], [12.0, 13.0]]
    cls = pool_texts(PoolSpec("h", "cls", True), {"h": hidden}, batch)["sentence_embedding"]
    np.testing.assert_allclose(cls, [[0.0, 1.0], [10 / np.hypot(10, 11), 11 / np.hypot(10, 11)]])
    with pytest.raises(ValueError, match=r"send inputs\.prompt, not token ids"):
        pool_texts(PoolSpec("h", "mean", False), {"h": hidden}, None)
