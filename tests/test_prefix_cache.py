"""`[generate] prefix_cache_mb`: a decoder's cache kept after a generation, so that a later
prompt beginning the same way runs only the rest. The tokens must be the ones a fresh prefill
gives (the GPT-2-like and Llama-like fixtures of `scripts/make_decoders.py`, against Hugging
Face's greedy tokens and against the same model without the cache)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from agent.client import AgentClient
from agent.demo.broker import EmbeddedBroker
from agent.inference import generate
from agent.models.backends.base import BackendOptions
from agent.models.backends.onnxruntime import OnnxRuntimeBackend, OnnxSession
from agent.models.decoder_layout import Generation, open_generation
from agent.models.generate_config import GenerateConfig
from agent.models.prefix_cache import MIN_SHARED, PrefixCache
from agent.service.agent import Agent
from tests.generate_helpers import DECODERS, REFERENCE, serve, tokens_by_member, tokens_of

N = 24
CACHE = "[generate]\nprefix_cache_mb = 16\n"
BATCHING = "[batching]\nmax_batch = 3\nmax_queue_delay_us = 200000\n"


def _store(max_bytes: int = 1 << 20) -> PrefixCache:
    return PrefixCache(max_bytes, {"past.key": (2, 4)}, None)


def _cache(tokens: int, fill: float = 1.0) -> dict[str, np.ndarray[Any, Any]]:
    return {"past.key": np.full((1, 2, tokens, 4), fill, dtype=np.float32)}


def test_the_longest_shared_beginning_is_cut_one_token_short() -> None:
    store = _store()
    store.keep(range(10), _cache(10))
    store.keep([0, 1, 2, 3, 4, 5, 50, 51], _cache(8, 2.0))
    hit = store.longest([0, 1, 2, 3, 4, 5, 6, 7, 99])
    assert hit is not None and hit.tokens == 8  # the first entry's, not the second's 6
    assert hit.cache["past.key"].shape == (1, 2, 8, 4) and hit.cache["past.key"].flags.c_contiguous
    whole = store.longest(list(range(10)))  # the same prompt: its last token runs again
    assert whole is not None and whole.tokens == 9
    assert store.longest([0, 1, 2, 9]) is None  # fewer than MIN_SHARED shared
    assert store.longest([7, 8, 9, 10, 11]) is None


def test_an_entry_that_holds_more_replaces_the_one_it_extends() -> None:
    store = _store()
    store.keep(range(6), _cache(6))
    store.keep(range(12), _cache(12))
    assert len(store) == 1 and store.nbytes == _cache(12)["past.key"].nbytes
    hit = store.longest(list(range(20)))
    assert hit is not None and hit.tokens == 12 and hit.cache["past.key"].shape[2] == 12


def test_the_least_recently_used_entries_go_past_the_bound() -> None:
    one = _cache(MIN_SHARED)["past.key"].nbytes
    store = _store(3 * one)
    for first in range(3):
        store.keep([first, 1, 2, 3], _cache(MIN_SHARED))
    assert store.longest([0, 1, 2, 3, 4]) is not None  # used: now the most recent
    store.keep([9, 1, 2, 3], _cache(MIN_SHARED))
    assert len(store) == 3 and store.nbytes == 3 * one
    assert store.longest([1, 1, 2, 3, 4]) is None  # the least recently used went
    assert store.longest([0, 1, 2, 3, 4]) is not None
    store.keep(range(50, 150), _cache(100))  # larger than the whole bound: not kept
    assert store.longest(list(range(50, 151))) is None
    two_rows = {"past.key": np.zeros((2, 2, MIN_SHARED, 4), np.float32)}
    store.keep(range(60, 60 + MIN_SHARED), two_rows)  # not one row holding the ids
    assert store.longest(list(range(60, 61 + MIN_SHARED))) is None
    store.clear()
    assert len(store) == 0 and store.nbytes == 0


Opened = tuple[Generation, OnnxSession]


def _opened(arch: str, mb: int) -> Opened:
    """The `arch` fixture's generation, its prefix cache `mb` MB (0: none), and its session."""
    session = OnnxRuntimeBackend().load(DECODERS / arch / "model.onnx", BackendOptions(1))
    return open_generation(GenerateConfig(prefix_cache_mb=mb), session, DECODERS / arch), session


def _run(opened: Opened, prompts: list[list[int]], n: int = N) -> list[generate.GenerateAsk]:
    """`prompts` as the members of one run, each generated to `n` tokens: their asks."""
    setup, session = opened
    asks = [
        generate.ask_of({"input_ids": np.array(ids)}, {"max_new_tokens": n}, setup)
        for ids in prompts
    ]
    _, tokens = tokens_by_member(session, asks)
    assert [ask.tokens for ask in asks] == [tokens[k] for k in range(len(asks))]
    return asks


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_prompt_run_again_and_one_that_goes_on_give_a_fresh_prefills_tokens(arch: str) -> None:
    """A prompt asked twice runs only its last token the second time; a prompt that goes on
    from an earlier answer (a conversation's next turn) runs only what is new. Every answer
    equals Hugging Face's, or the same model's without the cache."""
    cached, fresh = _opened(arch, 16), _opened(arch, 0)
    assert cached[0].prefix_cache is not None and fresh[0].prefix_cache is None
    for case in REFERENCE["models"][arch]:
        (first,) = _run(cached, [case["ids"]])
        (again,) = _run(cached, [case["ids"]])
        assert first.tokens == again.tokens == case["greedy"]
        assert (first.cached_tokens, again.cached_tokens) == (0, len(case["ids"]) - 1)
        assert again.usage["cached_tokens"] == len(case["ids"]) - 1
        longer = case["ids"] + case["greedy"][:5] + case["ids"][:3]  # past the kept answer
        (goes_on,) = _run(cached, [longer], 12)
        (reference,) = _run(fresh, [longer], 12)
        assert goes_on.cached_tokens == len(case["ids"]) + 5
        assert goes_on.tokens == reference.tokens
        assert "cached_tokens" not in reference.usage


def test_prompts_sharing_a_beginning_step_in_lock_step_from_the_cache() -> None:
    """Three prompts that share a system prompt's beginning, in one run of a batched model:
    each prefill starts from the cache the one before it kept, and the lock-step rows give
    the tokens of the same prompts without the cache."""
    cases = REFERENCE["models"]["llama"]
    shared = cases[1]["ids"]
    prompts = [shared + case["ids"] for case in cases]
    cached, fresh = _opened("llama", 16), _opened("llama", 0)
    assert cached[0].batchable
    got, want = _run(cached, prompts), _run(fresh, prompts)
    assert [a.tokens for a in got] == [a.tokens for a in want]
    assert [a.cached_tokens for a in got] == [0, len(shared), len(shared)]


@pytest.fixture(scope="module")
def cached_agent(
    broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Agent, AgentClient]]:
    models = {"cached": ("llama", CACHE), "fresh": ("llama", "")}
    yield from serve(broker, tmp_path_factory.mktemp("prefix"), models)


def test_a_conversations_next_turn_through_the_agent(
    cached_agent: tuple[Agent, AgentClient],
) -> None:
    """Over the broker: the second turn's `end` says how many prompt tokens the cache held
    (`usage.cached_tokens`), and its tokens are the uncached model's; the metrics count them
    and the bytes the cache holds."""
    _, client = cached_agent
    case = REFERENCE["models"]["llama"][0]
    params = {"max_new_tokens": 8}
    first = client.request("cached", {"input_ids": np.array(case["ids"])}, params=params)
    answer = tokens_of(list(first))
    assert answer == case["greedy"][:8] and "cached_tokens" not in first.end.usage
    turn = np.array(case["ids"] + answer + case["ids"])
    second = client.request("cached", {"input_ids": turn}, params=params)
    reference = client.request("fresh", {"input_ids": turn}, params=params)
    assert tokens_of(list(second)) == tokens_of(list(reference))
    assert second.end.usage["cached_tokens"] == len(case["ids"]) + 7
    assert "cached_tokens" not in reference.end.usage
    agent, _ = cached_agent
    samples = agent.metrics.registry.get_sample_value
    labels = {"model": "cached", "version": "1"}
    assert samples("edge_agent_prefix_cache_tokens_total", labels) == len(case["ids"]) + 7
    assert (samples("edge_agent_prefix_cache_bytes", labels) or 0) > 0
    assert samples("edge_agent_prefix_cache_bytes", {"model": "fresh", "version": "1"}) is None


def test_a_cache_kept_on_the_device_is_kept_and_cut_there(monkeypatch: pytest.MonkeyPatch) -> None:
    """ONNX Runtime's GPU path (the cache kept as the runtime's values; bound here on the
    CPU): the entries are those values, cut on the device for a shorter beginning, and a
    conversation's next turn gives the uncached tokens."""
    monkeypatch.setattr(OnnxSession, "keeps_on_device", property(lambda self: True))
    cached, fresh = _opened("llama", 16), _opened("llama", 0)
    store = cached[0].prefix_cache
    assert cached[0].device_cache and store is not None
    case = REFERENCE["models"]["llama"][0]
    (first,) = _run(cached, [case["ids"]])
    assert first.tokens == case["greedy"]
    longer = case["ids"] + case["greedy"][:5] + case["ids"][:3]
    (goes_on,) = _run(cached, [longer], 12)
    (reference,) = _run(fresh, [longer], 12)
    assert goes_on.cached_tokens == len(case["ids"]) + 5 and goes_on.tokens == reference.tokens
    hit = store.longest(longer)
    assert hit is not None and {type(v) for v in hit.cache.values()} == {ort.OrtValue}


@pytest.mark.parametrize(
    ("arch", "says"),
    [("gpt2_nocache", "exported without its cache")],
)
def test_settings_a_model_cannot_take_are_warned_about_at_load(
    arch: str, says: str, caplog: pytest.LogCaptureFixture
) -> None:
    """`prefix_cache_mb` and `prompt_lookup` in `[generate]` of a model whose cache cannot be
    kept or cut: the version loads without them, saying why."""
    session = OnnxRuntimeBackend().load(DECODERS / arch / "model.onnx", BackendOptions(1))
    config = GenerateConfig(prefix_cache_mb=8, prompt_lookup=4)
    with caplog.at_level("WARNING", logger="agent.models.decoder_layout"):
        setup = open_generation(config, session, DECODERS / arch)
    warned = [r.getMessage() for r in caplog.records]
    assert setup.prefix_cache is None and setup.prompt_lookup == 0
    assert any("prefix_cache_mb is not applied" in m and says in m for m in warned), warned
    assert any("prompt_lookup is not applied" in m and says in m for m in warned), warned
