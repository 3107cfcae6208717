"""`mode = "generate"` over the decoder families users bring, beyond the GPT-2-like and
Llama-like fixtures: optimum's `text-generation-with-past` exports of seeded random qwen2,
phi3, gemma2, bloom, mpt, falcon, gpt_neox, opt, gpt_bigcode, stablelm, qwen3 and granite
models (tests/fixtures/real/families, made by scripts/make_decoder_families.py; grouped and
multi-query attention, fused qkv, ALiBi, soft-capping, a sliding window, partial rotary,
learned positions, multipliers). The agent's tokens are Hugging Face's greedy
`generate(do_sample=False)` ones, a request alone and, where the export takes
`position_ids` or its positions are ALiBi's, three prompts in lock-step; over a broker, the
streamed text is the tokenizer's decode of them."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from tokenizers import Tokenizer

from agent.client import AgentClient
from agent.demo.broker import EmbeddedBroker
from agent.inference import generate
from agent.models.backends.base import BackendOptions
from agent.models.backends.onnxruntime import OnnxRuntimeBackend, OnnxSession
from agent.models.decoder_layout import Generation, open_generation
from agent.service.agent import Agent
from tests.generate_helpers import DECODERS, GENERATE, streamed, tokens_by_member, tokens_of

FAMILIES = DECODERS.parent / "families"
REFERENCE: dict[str, Any] = json.loads((FAMILIES / "reference.json").read_text(encoding="utf-8"))
NEW = int(REFERENCE["new_tokens"])
TOKENIZER = DECODERS / "gpt2" / "tokenizer.json"  # the families' ids are its ids
# Without `position_ids` a row cannot be left-padded (gemma2's export derives its positions
# from the cache's length): its requests generate one at a time. Bloom and MPT take none
# either, but their positions are ALiBi biases, which the padding leaves as they are.
NOT_BATCHABLE = {"gemma2"}
ALIBI = {"bloom", "mpt"}
NAMES = sorted(REFERENCE["families"])
BATCHABLE = [name for name in NAMES if name not in NOT_BATCHABLE]
BATCHING = "[batching]\nmax_batch = 3\nmax_queue_delay_us = 200000\n"
SERVED = ["bloom", "qwen2"]  # over the broker: one without position_ids, one with


def _open(family: str) -> tuple[OnnxSession, Generation]:
    """The family's export on ONNX Runtime's CPU provider (one thread), and its generation."""
    session = OnnxRuntimeBackend().load(FAMILIES / family / "model.onnx", BackendOptions(1))
    return session, open_generation(None, session, FAMILIES / family)


def _asks(setup: Generation, family: str, limits: list[int]) -> list[generate.GenerateAsk]:
    """A generation of each reference prompt's ids, `limits` new tokens each."""
    cases = REFERENCE["families"][family]["cases"]
    return [
        generate.ask_of({"input_ids": np.array(case["ids"])}, {"max_new_tokens": n}, setup)
        for case, n in zip(cases, limits, strict=True)
    ]


def test_the_fixtures_are_the_twelve_families() -> None:
    assert set(NAMES) == {
        "qwen2",
        "phi3",
        "gemma2",
        "bloom",
        "mpt",
        "falcon",
        "gpt_neox",
        "opt",
        "gpt_bigcode",
        "stablelm",
        "qwen3",
        "granite",
    }
    assert NOT_BATCHABLE.issubset(NAMES)


@pytest.mark.parametrize("family", NAMES)
def test_layout_and_batchability_follow_the_exports_inputs(family: str) -> None:
    """Every export has `attention_mask` and a key and a value per layer; gemma2, bloom and
    mpt have no `position_ids`: gemma2 is not batchable (a version of it with `[batching]` is
    refused at load: below), bloom and mpt are by their ALiBi positions, the others are."""
    session, setup = _open(family)
    recorded = REFERENCE["families"][family]["inputs"]
    assert [spec.name for spec in session.inputs] == recorded
    layout = setup.layout
    assert layout.attention_mask == "attention_mask"
    assert len(layout.cache) == 4 and all(slot.past_axis == 2 for slot in layout.cache)
    assert setup.eos == frozenset({REFERENCE["eos"]})
    # The context from each config's own key (MPT's `max_seq_len`); ALiBi's bloom names none.
    assert setup.context == (None if family == "bloom" else 64)
    if family in NOT_BATCHABLE | ALIBI:
        assert "position_ids" not in recorded and layout.position_ids is None
        assert setup.batchable is (family in ALIBI) is layout.alibi
    else:
        assert layout.position_ids == "position_ids"
        assert setup.batchable


@pytest.mark.parametrize("family", NAMES)
def test_greedy_tokens_equal_hugging_face(family: str) -> None:
    """Each prompt alone: the prefill, then one run a token on the cache; the tokens are
    Hugging Face's greedy ones, to the limit."""
    session, setup = _open(family)
    cases = REFERENCE["families"][family]["cases"]
    for case, ask in zip(cases, _asks(setup, family, [NEW] * len(cases)), strict=True):
        run, tokens = tokens_by_member(session, [ask])
        assert tokens[0] == case["greedy"], case["prompt"]
        assert ask.finish_reason == "length"
        assert run.runs == NEW


@pytest.mark.parametrize("family", BATCHABLE)
def test_three_prompts_in_lock_step_equal_hugging_face(family: str) -> None:
    """The three prompts (8, 9 and 16 ids) in one run: each prefill alone, then one run a
    step for all, the shorter caches left-padded and masked, rows leaving at their limits;
    every row's tokens are Hugging Face's."""
    session, setup = _open(family)
    cases, limits = REFERENCE["families"][family]["cases"], [NEW, 7, 12]
    asks = _asks(setup, family, limits)
    assert len({len(a.prompt) for a in asks}) == 3
    run, tokens = tokens_by_member(session, asks)
    for position, (case, n) in enumerate(zip(cases, limits, strict=True)):
        assert tokens[position] == case["greedy"][:n], case["prompt"]
        assert asks[position].finish_reason == "length"
    assert run.runs == 3 + NEW - 1  # the prefills, then one run a step


@pytest.fixture(scope="module")
def agent_client(
    broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Agent, AgentClient]]:
    """An agent serving SERVED as users copy them: the export's files, the tokenizer."""
    from tests.conftest import agent_config, serve_agent

    tmp = tmp_path_factory.mktemp("families")
    root = tmp / "models"
    for family in SERVED:
        shutil.copytree(FAMILIES / family, root / family / "1")
        shutil.copy(TOKENIZER, root / family / "1" / "tokenizer.json")
        (root / family / "config.toml").write_text(GENERATE)
    for family in ("bloom", "gemma2"):
        shutil.copytree(FAMILIES / family, root / f"{family}_batched" / "1")
        shutil.copy(TOKENIZER, root / f"{family}_batched" / "1" / "tokenizer.json")
        (root / f"{family}_batched" / "config.toml").write_text(GENERATE + BATCHING)
    yield from serve_agent(broker, agent_config(tmp, broker, root), 20)


def test_the_served_versions_load(agent_client: tuple[Agent, AgentClient]) -> None:
    """SERVED load, and bloom under `[batching]`; gemma2 under `[batching]` fails, saying
    why."""
    agent, _ = agent_client
    models = agent.models.inventory()["models"]
    assert sorted(models) == sorted([*SERVED, "bloom_batched", "gemma2_batched"])
    for name in [*SERVED, "bloom_batched"]:
        assert models[name]["versions"]["1"]["state"] == "ready"
    batched = models["gemma2_batched"]["versions"]["1"]
    assert batched["state"] == "failed" and "position_ids" in batched["error"]


def test_alibi_prompts_queued_together_step_in_lock_step_over_the_broker(
    agent_client: tuple[Agent, AgentClient],
) -> None:
    """Bloom's three prompts at once under `[batching]`: one run, the shorter caches
    left-padded with no `position_ids`; each gets Hugging Face's tokens and their text."""
    agent, client = agent_client
    cases, limits = REFERENCE["families"]["bloom"]["cases"], [NEW, 7, 12]
    replies = [
        client.request(
            "bloom_batched", {"prompt": c["prompt"]}, params={"max_new_tokens": n}, timeout=30
        )
        for c, n in zip(cases, limits, strict=True)
    ]
    codec = Tokenizer.from_file(str(TOKENIZER))
    for case, n, reply in zip(cases, limits, replies, strict=True):
        chunks = list(reply)
        assert tokens_of(chunks) == case["greedy"][:n], case["prompt"]
        assert "".join(str(c.text) for c in chunks) == codec.decode(case["greedy"][:n])
        assert reply.end is not None and reply.end.finish_reason == "length"
    samples = agent.metrics.registry.get_sample_value
    runs = samples("edge_agent_batch_requests_count", {"model": "bloom_batched"})
    requests = samples("edge_agent_batch_requests_sum", {"model": "bloom_batched"})
    assert (runs, requests) == (1, 3)  # all three in one run


@pytest.mark.parametrize(("family", "case"), [(f, k) for f in SERVED for k in range(3)])
def test_a_prompt_over_the_broker_streams_hugging_faces_tokens_and_their_text(
    agent_client: tuple[Agent, AgentClient], family: str, case: int
) -> None:
    """`inputs: {prompt: ...}`, encoded by the tokenizer beside the model: the streamed
    tokens are Hugging Face's for the reference's ids, the stream ends `length`, and the
    chunks' text put together is the tokenizer's decode of the tokens."""
    _, client = agent_client
    ref = REFERENCE["families"][family]["cases"][case]
    reply, chunks = streamed(client, family, {"prompt": ref["prompt"]}, max_new_tokens=NEW)
    tokens = tokens_of(chunks)
    assert tokens == ref["greedy"]
    assert reply.end is not None and reply.end.finish_reason == "length"
    assert reply.end.usage == {"prompt_tokens": len(ref["ids"]), "completion_tokens": NEW}
    text = "".join(str(c.text) for c in chunks)
    assert text == Tokenizer.from_file(str(TOKENIZER)).decode(tokens) == ref["text"]
