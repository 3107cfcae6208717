"""`params.prompt_lookup` (and `[generate] prompt_lookup`): tokens guessed from where the text's
ending stood before, checked in one run with the step's token, kept while each is the greedy
choice. The tokens must be one-run-a-token greedy's: Hugging Face's for the GPT-2-like and
Llama-like fixtures and the twelve families, in fewer runs where the guesses hold."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from agent.client import AgentClient, AgentError
from agent.demo.broker import EmbeddedBroker
from agent.inference import generate
from agent.inference.prompt_lookup import MAX_PAUSE, Lookup
from agent.models.backends.base import BackendOptions
from agent.models.backends.onnxruntime import OnnxRuntimeBackend, OnnxSession
from agent.models.decoder_layout import open_generation
from agent.models.generate_config import GenerateConfig
from agent.service.agent import Agent
from tests.generate_helpers import DECODERS, REFERENCE, serve, tokens_by_member, tokens_of

FAMILIES = DECODERS.parent / "families"
FAMILY_REFERENCE: dict[str, Any] = json.loads(
    (FAMILIES / "reference.json").read_text(encoding="utf-8")
)
# (folder, its reference cases, new tokens): the two decoders and the twelve families.
FIXTURES = {
    "gpt2": (DECODERS / "gpt2", REFERENCE["models"]["gpt2"], 24),
    "llama": (DECODERS / "llama", REFERENCE["models"]["llama"], 24),
} | {
    name: (FAMILIES / name, entry["cases"], int(FAMILY_REFERENCE["new_tokens"]))
    for name, entry in FAMILY_REFERENCE["families"].items()
}


def test_a_guess_is_what_followed_the_latest_pair_else_the_latest_token() -> None:
    lookup = Lookup(8, [5, 6, 7, 1, 2, 9, 5, 6, 8, 3])
    lookup.push([5, 6])
    assert lookup.guesses(8) == [8, 3, 5, 6]  # after the latest earlier (5, 6): at 7-8
    assert lookup.guesses(2) == [8, 3]  # the room left
    lookup.push([2])
    assert lookup.guesses(8) == [9, 5, 6, 8, 3, 5, 6, 2]  # (6, 2) stood nowhere: after 2
    lookup.push([4])
    assert lookup.guesses(8) == []  # 4 stood nowhere before


def test_the_guesses_grow_while_right_and_wait_after_a_miss() -> None:
    lookup = Lookup(8, [1, 2, 3, 1, 2, 3, 1, 2])
    lookup.checked(guessed=8, right=8)
    assert lookup.size == 8
    lookup.checked(guessed=8, right=3)
    assert lookup.size == 3 and lookup.guesses(8) == [3, 1, 2]  # at most 3 next time
    lookup.checked(guessed=3, right=1)
    assert lookup.guesses(8) == [3]
    lookup.checked(guessed=1, right=1)
    assert lookup.size == 2 and lookup.guesses(8) == [3, 1]
    for wait in (1, 2, 4, 8, MAX_PAUSE, MAX_PAUSE):  # each run of none right waits longer
        lookup.checked(guessed=1, right=0)
        assert [lookup.guesses(8) for _ in range(wait)] == [[]] * wait
        assert lookup.guesses(8) == [3]
    lookup.checked(guessed=1, right=1)  # a right one ends the waiting
    lookup.checked(guessed=1, right=0)
    assert lookup.guesses(8) == [] and lookup.guesses(8) == [3]


def _tokens_and_runs(folder: Path, ids: list[int], n: int, lookup: int, **config: Any) -> Any:
    session = OnnxRuntimeBackend().load(folder / "model.onnx", BackendOptions(1))
    setup = open_generation(GenerateConfig(**config), session, folder)
    params = {"max_new_tokens": n, "prompt_lookup": lookup}
    ask = generate.ask_of({"input_ids": np.array(ids)}, params, setup)
    run, tokens = tokens_by_member(session, [ask])
    return tokens[0], run.runs, ask


def test_the_tokens_are_greedys_in_fewer_runs() -> None:
    """Every fixture prompt with 8 guesses a run: Hugging Face's greedy tokens, to the limit;
    and for most fixtures fewer runs than tokens (their outputs repeat themselves)."""
    fewer = []
    for name, (folder, cases, n) in sorted(FIXTURES.items()):
        runs = 0
        for case in cases:
            tokens, ran, ask = _tokens_and_runs(folder, case["ids"], n, 8)
            assert tokens == case["greedy"][:n], (name, case["prompt"])
            assert ask.finish_reason == "length"
            runs += ran
        if runs < len(cases) * n:
            fewer.append(name)
    assert len(fewer) >= len(FIXTURES) // 2, fewer


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_cache_kept_on_the_device_is_cut_there(
    arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ONNX Runtime's GPU path (the cache kept as the runtime's values, bound here on the
    CPU): the guesses' run keeps the cache bound, the cut happens without a host copy (a
    Slice run, `ort_cut`), and the tokens are greedy's in fewer runs than tokens."""
    monkeypatch.setattr(OnnxSession, "keeps_on_device", property(lambda self: True))
    cut = OnnxSession.cut_kept
    cuts: list[type] = []

    def spy(self: OnnxSession, value: Any, axis: int, length: int) -> Any:
        made = cut(self, value, axis, length)
        cuts.append(type(made))
        return made

    monkeypatch.setattr(OnnxSession, "cut_kept", spy)
    folder, cases, n = FIXTURES[arch]
    runs = 0
    for case in cases:
        tokens, ran, _ = _tokens_and_runs(folder, case["ids"], n, 8)
        assert tokens == case["greedy"][:n], case["prompt"]
        runs += ran
    assert cuts and set(cuts) == {ort.OrtValue}
    if arch == "gpt2":
        assert runs < len(cases) * n


def test_an_eos_among_the_guesses_ends_the_generation_there() -> None:
    """An eos the greedy path reaches inside a run of kept guesses ends it at that token, and
    the cache kept for the prefix cache is the one the tokens before it made."""
    case = REFERENCE["models"]["gpt2"][1]
    plain, _, _ = _tokens_and_runs(DECODERS / "gpt2", case["ids"], 24, 0)
    eos_at = next(i for i in range(4, 24) if plain[i] not in plain[:i])
    eos = [plain[eos_at]]
    tokens, _, ask = _tokens_and_runs(DECODERS / "gpt2", case["ids"], 24, 8, eos=eos)
    assert tokens == plain[: eos_at + 1] and ask.finish_reason == "eos"


def test_with_the_prefix_cache_the_next_turn_is_greedys_too() -> None:
    case = REFERENCE["models"]["gpt2"][0]
    session = OnnxRuntimeBackend().load(DECODERS / "gpt2" / "model.onnx", BackendOptions(1))
    setup = open_generation(GenerateConfig(prefix_cache_mb=8), session, DECODERS / "gpt2")
    params = {"max_new_tokens": 24, "prompt_lookup": 8}
    first = generate.ask_of({"input_ids": np.array(case["ids"])}, params, setup)
    tokens_by_member(session, [first])
    turn = case["ids"] + first.tokens + case["ids"]
    second = generate.ask_of({"input_ids": np.array(turn)}, {"max_new_tokens": 12}, setup)
    _, got = tokens_by_member(session, [second])
    want, _, _ = _tokens_and_runs(DECODERS / "gpt2", turn, 12, 0)
    assert first.tokens == case["greedy"] and got[0] == want
    assert second.cached_tokens == len(case["ids"]) + 23


@pytest.fixture(scope="module")
def lookup_agent(
    broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Agent, AgentClient]]:
    models = {
        "gpt2": ("gpt2", ""),
        "gpt2_lookup": ("gpt2", "[generate]\nprompt_lookup = 8\n"),
        "gpt2_nocache": ("gpt2_nocache", ""),
    }
    yield from serve(broker, tmp_path_factory.mktemp("lookup"), models)


def test_a_stream_with_guesses_carries_greedys_tokens_and_text(
    lookup_agent: tuple[Agent, AgentClient],
) -> None:
    """Over the broker, from the config's default and from the request's params: a chunk
    may carry several tokens (those one run kept); together they are greedy's, and their
    text the decode of them."""
    _, client = lookup_agent
    case = REFERENCE["models"]["gpt2"][0]
    for model, params in (("gpt2_lookup", {}), ("gpt2", {"prompt_lookup": 8})):
        reply = client.request(
            model, {"prompt": case["prompt"]}, params={"max_new_tokens": 24, **params}
        )
        chunks = list(reply)
        assert tokens_of(chunks) == case["greedy"]
        assert "".join(c.text for c in chunks) == case["text"]
        assert len(chunks) < 24  # some chunk carried a run's kept guesses
    sampled = client.request(  # the config's default does not apply to a sampled request
        "gpt2_lookup",
        {"prompt": case["prompt"]},
        params={"max_new_tokens": 8, "temperature": 0.7, "seed": 3},
    )
    assert len(tokens_of(list(sampled))) == 8


@pytest.mark.parametrize(
    ("model", "params", "says"),
    [
        ("gpt2", {"prompt_lookup": 4, "temperature": 0.5}, "greedy search of one sequence"),
        ("gpt2", {"prompt_lookup": 4, "num_beams": 2}, "greedy search of one sequence"),
        ("gpt2", {"prompt_lookup": 33}, "prompt_lookup"),
        ("gpt2", {"prompt_lookup": True}, "prompt_lookup"),
        ("gpt2_nocache", {"prompt_lookup": 4}, "a decoder alone with its cache"),
    ],
)
def test_a_lookup_that_cannot_apply_is_refused(
    lookup_agent: tuple[Agent, AgentClient], model: str, params: dict[str, Any], says: str
) -> None:
    _, client = lookup_agent
    case = REFERENCE["models"]["gpt2"][0]
    with pytest.raises(AgentError, match=r"bad_request.*" + says):
        client.request(model, {"prompt": case["prompt"]}, params=params, stream=False).collect()
