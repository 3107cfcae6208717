"""`mode = "generate"` with real optimum exports (a GPT-2-like and a Llama-like decoder with
grouped-query attention and rotary positions; the GPT-2-like one fused by ONNX Runtime's
transformer optimizer, and quantized to int8 by ONNX Runtime; a smaller one exported without
its cache, and merged as optimum's older exports were): greedy tokens equal to
Hugging Face's `generate(do_sample=False)`, text equal to the tokenizer's decode, finish
reasons and usage, stop strings, max_new_tokens, context overflow refused, `stream: false`,
tokens_per_chunk."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import onnx
import pytest

from agent.client import AgentClient, AgentError
from agent.demo.broker import EmbeddedBroker
from agent.inference import sampling
from agent.models.tokenizer import open_tokenizer
from agent.service.agent import Agent
from tests.generate_helpers import DECODERS, EOS, REFERENCE, serve
from tests.test_sources import Subscriber, subscribe

__all__ = ["subscribe"]  # the fixture, used by name

# Requests queued within 0.2 s share runs: their steps go in lock-step, a row each.
BATCHING = "[batching]\nmax_batch = 3\nmax_queue_delay_us = 200000\n"
CASES = [(arch, k) for arch in ("gpt2", "llama") for k in range(3)]
N = 24


@pytest.fixture(scope="module")
def agent_client(
    broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Agent, AgentClient]]:
    eos_at = REFERENCE["models"]["gpt2"][0]["greedy"][5]  # an eos the greedy path reaches
    models = {
        "gpt2": ("gpt2", ""),
        "llama": ("llama", ""),
        "gpt2_optimized": ("gpt2_optimized", ""),
        "gpt2_int8": ("gpt2_int8", ""),
        "gpt2_nocache": ("gpt2_nocache", ""),
        "gpt2_merged": ("gpt2_merged", ""),
        "gpt2_merged_batched": ("gpt2_merged", BATCHING),
        "gpt2_ids": ("gpt2", ""),
        "gpt2_eos": ("gpt2", f"[generate]\neos = [{eos_at}]\n"),
        "gpt2_short": ("gpt2", "[generate]\ncontext = 12\nmax_new_tokens = 8\n"),
        "llama_batched": ("llama", BATCHING),
    }
    yield from serve(broker, tmp_path_factory.mktemp("generate"), models)


def generate(
    client: AgentClient,
    model: str,
    inputs: dict[str, Any],
    request_id: str | None = None,
    **params: Any,
) -> Any:
    reply = client.request(model, inputs, params=params or None, timeout=30, request_id=request_id)
    chunks = list(reply)
    return reply, chunks


def tokens_of(chunks: list[Any]) -> list[int]:
    return [int(t) for c in chunks for t in c.outputs["tokens"]]


def test_versions_load(agent_client: tuple[Agent, AgentClient]) -> None:
    agent, _ = agent_client
    for name, entry in agent.models.inventory()["models"].items():
        assert entry["versions"]["1"]["state"] == "ready", (name, entry)


@pytest.mark.parametrize(("arch", "case"), CASES)
def test_greedy_tokens_and_text_equal_hugging_face(
    agent_client: tuple[Agent, AgentClient], arch: str, case: int
) -> None:
    _, client = agent_client
    ref = REFERENCE["models"][arch][case]
    reply, chunks = generate(client, arch, {"prompt": ref["prompt"]}, max_new_tokens=N)
    assert tokens_of(chunks) == ref["greedy"]
    assert [c.index for c in chunks] == list(range(N))
    assert "".join(c.text for c in chunks) == ref["text"]
    assert reply.end.finish_reason == "length"
    assert reply.end.usage == {"prompt_tokens": len(ref["ids"]), "completion_tokens": N}
    assert reply.end.timing["ttft_ms"] <= reply.end.timing["total_ms"]


@pytest.mark.parametrize(("arch", "case"), CASES)
def test_beam_search_equals_hugging_face(
    agent_client: tuple[Agent, AgentClient], arch: str, case: int
) -> None:
    """`params.num_beams = 3`: `generate(num_beams=3)`'s tokens and finish (the prompt's
    prefill run once, then three rows a step, their caches gathered as the beams move)."""
    _, client = agent_client
    ref = REFERENCE["models"][arch][case]
    inputs = {"prompt": ref["prompt"]}
    reply, chunks = generate(client, arch, inputs, max_new_tokens=N, num_beams=3)
    assert tokens_of(chunks) == ref["beam"]["tokens"]
    assert reply.end.finish_reason == ref["beam"]["finish"]


@pytest.mark.parametrize("case", range(3))
def test_an_export_fused_by_onnx_runtimes_optimizer_streams_the_same_tokens(
    agent_client: tuple[Agent, AgentClient], case: int
) -> None:
    """Fused operators of the `com.microsoft` domain (SkipLayerNormalization, FastGelu) load
    and run as they are: the tokens and text are Hugging Face's for the unfused model."""
    _, client = agent_client
    graph = onnx.load(str(DECODERS / "gpt2_optimized" / "model.onnx"), load_external_data=False)
    assert {n.op_type for n in graph.graph.node if n.domain == "com.microsoft"} >= {
        "SkipLayerNormalization",
        "FastGelu",
    }
    ref = REFERENCE["models"]["gpt2"][case]
    reply, chunks = generate(client, "gpt2_optimized", {"prompt": ref["prompt"]}, max_new_tokens=N)
    assert tokens_of(chunks) == ref["greedy"]
    assert "".join(c.text for c in chunks) == ref["text"]
    assert reply.end.finish_reason == "length"


@pytest.mark.parametrize("case", range(3))
def test_an_int8_quantized_decoder_streams_onnx_runtimes_tokens(
    agent_client: tuple[Agent, AgentClient], case: int
) -> None:
    """ONNX Runtime's dynamic quantization (int8 weights, what `optimum-cli onnxruntime
    quantize` runs) loads as it is; its greedy tokens are a plain ONNX Runtime loop's."""
    _, client = agent_client
    graph = onnx.load(str(DECODERS / "gpt2_int8" / "model.onnx"), load_external_data=False)
    assert "DynamicQuantizeLinear" in {n.op_type for n in graph.graph.node}
    ref = REFERENCE["int8"][case]
    _, chunks = generate(client, "gpt2_int8", {"prompt": ref["prompt"]}, max_new_tokens=N)
    assert tokens_of(chunks) == ref["greedy"]


@pytest.mark.parametrize("case", range(3))
def test_a_decoder_exported_without_its_cache_runs_the_whole_sequence(
    agent_client: tuple[Agent, AgentClient], case: int
) -> None:
    """optimum's `text-generation` task exports no `past_key_values.*`: each step feeds the
    prompt and every new token again, and the tokens are Hugging Face's."""
    _, client = agent_client
    graph = onnx.load(str(DECODERS / "gpt2_nocache" / "model.onnx"), load_external_data=False)
    assert [i.name for i in graph.graph.input] == ["input_ids", "attention_mask", "position_ids"]
    ref = REFERENCE["models"]["gpt2_nocache"][case]
    reply, chunks = generate(client, "gpt2_nocache", {"prompt": ref["prompt"]}, max_new_tokens=N)
    assert tokens_of(chunks) == ref["greedy"]
    assert "".join(c.text for c in chunks) == ref["text"]
    assert reply.end.usage == {"prompt_tokens": len(ref["ids"]), "completion_tokens": N}


@pytest.mark.parametrize("case", range(3))
def test_an_older_merged_export_takes_its_cache_branch(
    agent_client: tuple[Agent, AgentClient], case: int
) -> None:
    """optimum's older exports: one graph holding the decoder without and with a past, an If
    choosing by `use_cache_branch` (false for the prefill, true after)."""
    _, client = agent_client
    graph = onnx.load(str(DECODERS / "gpt2_merged" / "model.onnx"), load_external_data=False)
    assert "use_cache_branch" in [i.name for i in graph.graph.input]
    assert [n.op_type for n in graph.graph.node] == ["If"]
    ref = REFERENCE["models"]["gpt2_merged"][case]
    _reply, chunks = generate(client, "gpt2_merged", {"prompt": ref["prompt"]}, max_new_tokens=N)
    assert tokens_of(chunks) == ref["greedy"]
    assert "".join(c.text for c in chunks) == ref["text"]


def test_input_ids_without_a_tokenizer(agent_client: tuple[Agent, AgentClient]) -> None:
    _, client = agent_client
    ref = REFERENCE["models"]["gpt2"][1]
    ids = np.array([ref["ids"]], dtype=np.int64)
    _reply, chunks = generate(client, "gpt2_ids", {"input_ids": ids}, max_new_tokens=N)
    assert tokens_of(chunks) == ref["greedy"]
    assert all(c.text is None for c in chunks)
    with pytest.raises(AgentError, match="tokenizer"):
        generate(client, "gpt2_ids", {"prompt": "hello"})


def test_tokens_per_chunk(agent_client: tuple[Agent, AgentClient]) -> None:
    _, client = agent_client
    ref = REFERENCE["models"]["llama"][2]
    reply, chunks = generate(
        client, "llama", {"prompt": ref["prompt"]}, max_new_tokens=10, tokens_per_chunk=4
    )
    assert [len(c.outputs["tokens"]) for c in chunks] == [4, 4, 2]
    assert [c.index for c in chunks] == [0, 4, 8]
    assert tokens_of(chunks) == ref["greedy"][:10]
    assert reply.end.chunks == 3


def test_stream_false_gives_tokens_and_text(agent_client: tuple[Agent, AgentClient]) -> None:
    _, client = agent_client
    ref = REFERENCE["models"]["gpt2"][2]
    reply = client.request(
        "gpt2", {"prompt": ref["prompt"]}, stream=False, params={"max_new_tokens": N}
    )
    outputs = reply.collect()
    assert outputs["tokens"].tolist() == ref["greedy"]
    assert reply.text == ref["text"]
    assert reply.finish_reason == "length"
    assert reply.usage == {"prompt_tokens": len(ref["ids"]), "completion_tokens": N}


def test_eos_ends_the_stream(agent_client: tuple[Agent, AgentClient]) -> None:
    _, client = agent_client
    ref = REFERENCE["models"]["gpt2"][0]
    reply, chunks = generate(client, "gpt2_eos", {"prompt": ref["prompt"]}, max_new_tokens=N)
    assert tokens_of(chunks) == ref["greedy"][:6]  # the eos token is the last one sent
    assert reply.end.finish_reason == "eos"
    assert reply.end.usage["completion_tokens"] == 6


def test_the_configured_eos_comes_from_generation_config(
    agent_client: tuple[Agent, AgentClient],
) -> None:
    agent, _ = agent_client
    with agent.models.lease("gpt2", None) as lease:
        generation = lease.loaded.generation
    assert generation is not None
    assert generation.eos == frozenset({EOS})
    assert generation.context == 128


def test_a_stop_string_ends_the_text_before_it(agent_client: tuple[Agent, AgentClient]) -> None:
    _, client = agent_client
    ref = REFERENCE["models"]["llama"][0]
    full = ref["text"]
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop and stop.strip()
    reply, chunks = generate(
        client, "llama", {"prompt": ref["prompt"]}, max_new_tokens=N, stop=[stop]
    )
    text = "".join(c.text for c in chunks)
    assert text == full[: full.find(stop)]
    assert reply.end.finish_reason == "stop"
    assert tokens_of(chunks) == ref["greedy"][: len(tokens_of(chunks))]


def test_max_new_tokens_and_the_context(agent_client: tuple[Agent, AgentClient]) -> None:
    _, client = agent_client
    ids = REFERENCE["models"]["gpt2"][1]["ids"]  # 8 or so tokens of a context of 12
    reply, chunks = generate(client, "gpt2_short", {"input_ids": np.array(ids, np.int64)})
    assert len(tokens_of(chunks)) == 12 - len(ids)  # capped by the context
    assert reply.end.finish_reason == "length"
    reply, chunks = generate(
        client, "gpt2", {"input_ids": np.array(ids, np.int64)}, max_new_tokens=3
    )
    assert len(tokens_of(chunks)) == 3
    with pytest.raises(AgentError, match="context") as raised:
        generate(client, "gpt2_short", {"input_ids": np.arange(12, dtype=np.int64)})
    assert raised.value.code == "bad_request"


@pytest.mark.parametrize(
    ("inputs", "params", "match"),
    [
        ({"prompt": "hi", "input_ids": np.array([1], np.int64)}, {}, "takes"),
        ({"input_ids": np.array([1.0], np.float32)}, {}, "integer"),
        ({"input_ids": np.array([999], np.int64)}, {}, "token ids"),
        ({"prompt": ""}, {}, "empty"),
        ({"prompt": "hi"}, {"max_new_tokens": 0}, "max_new_tokens"),
        ({"prompt": "hi"}, {"tokens_per_chunk": 0}, "tokens_per_chunk"),
        ({"prompt": "hi"}, {"stop": "x"}, "stop"),
        ({"prompt": "hi"}, {"temperature": -1}, "temperature"),
        ({"prompt": "hi"}, {"top_p": 0}, "top_p"),
        ({"prompt": "hi"}, {"top_k": -2}, "top_k"),
    ],
)
def test_bad_requests_are_refused(
    agent_client: tuple[Agent, AgentClient], inputs: Any, params: Any, match: str
) -> None:
    """Refused with `bad_request`; bad params at arrival, before taking a queue slot (a
    prompt's faults on the worker, which tokenizes it)."""
    agent, client = agent_client
    at_arrival = agent.counters["rejected_bad_request"]
    with pytest.raises(AgentError, match=match) as raised:
        generate(client, "gpt2", inputs, **params)
    assert raised.value.code == "bad_request"
    arrived = agent.counters["rejected_bad_request"] - at_arrival
    assert arrived == (1 if params else 0)


def test_sampling_without_a_seed_follows_the_request_id(
    agent_client: tuple[Agent, AgentClient],
) -> None:
    """A sampled request that names no seed is seeded from its id, so run again under that
    id (a stored request after a crash: the same path) it samples the same tokens, and the
    messages a subscriber kept by (id, seq) stay one sample; another id samples otherwise."""
    _, client = agent_client
    params = {"max_new_tokens": 16, "temperature": 1.5}
    unseeded = tokens_of(generate(client, "gpt2", {"prompt": "hi"}, "sampled-1", **params)[1])
    other = tokens_of(generate(client, "gpt2", {"prompt": "hi"}, "sampled-2", **params)[1])
    seeded = {**params, "seed": int(sampling.replayable(params, "sampled-1")["seed"])}
    named = tokens_of(generate(client, "gpt2", {"prompt": "hi"}, "sampled-3", **seeded)[1])
    assert unseeded == named != other


def test_three_concurrent_requests_get_their_own_tokens(
    agent_client: tuple[Agent, AgentClient],
) -> None:
    _, client = agent_client
    cases = [("gpt2", 0), ("llama", 1), ("gpt2", 2)]
    replies = [
        client.request(
            arch,
            {"prompt": REFERENCE["models"][arch][k]["prompt"]},
            params={"max_new_tokens": N},
            timeout=30,
        )
        for arch, k in cases
    ]
    for (arch, k), reply in zip(cases, replies, strict=True):
        assert tokens_of(list(reply)) == REFERENCE["models"][arch][k]["greedy"]


def test_a_finished_generate_stream_is_resent(agent_client: tuple[Agent, AgentClient]) -> None:
    _, client = agent_client
    ref = REFERENCE["models"]["llama"][1]
    reply = client.request(
        "llama",
        {"prompt": ref["prompt"]},
        request_id="gen-resend-1",
        params={"max_new_tokens": 8, "tokens_per_chunk": 3},
        timeout=30,
    )
    first = list(reply)
    again = client.replay("llama", "gen-resend-1", timeout=30)
    second = list(again)
    assert [c.seq for c in second] == [c.seq for c in first]
    assert tokens_of(second) == ref["greedy"][:8]
    assert [c.text for c in second] == [c.text for c in first]
    assert again.end is not None and again.end.finish_reason == "length"


def test_reply_compression_applies_to_tokens(
    agent_client: tuple[Agent, AgentClient],
    broker: EmbeddedBroker,
    subscribe: Callable[..., Subscriber],
) -> None:
    """`params.reply_compression` as in every mode: each chunk's tokens travel as one zstd
    byte string (the text beside them, as every other per-chunk key, does not); a value
    that is not known is refused."""
    agent, client = agent_client
    ref = REFERENCE["models"]["gpt2"][1]
    wire = subscribe(broker, f"{agent.root}/result/gpt2/gen-zstd-1")
    _reply, chunks = generate(
        client,
        "gpt2",
        {"prompt": ref["prompt"]},
        max_new_tokens=6,
        reply_compression="zstd",
        request_id="gen-zstd-1",
    )
    assert tokens_of(chunks) == ref["greedy"][:6]
    # the test's own subscriber may still be reading what the client already has
    assert wire.wait_for(lambda ms: any(m.get("type") == "end" for m in ms), 10)
    sent = wire.bodies("chunk")
    assert len(sent) == 6 and all(m["compression"] == "zstd" for m in sent)
    assert all(isinstance(m["outputs"], bytes) and "text" in m for m in sent)
    whole = client.request(
        "gpt2",
        {"prompt": ref["prompt"]},
        stream=False,
        params={"max_new_tokens": 6, "reply_compression": "zstd"},
        timeout=30,
    )
    assert whole.collect()["tokens"].tolist() == ref["greedy"][:6]
    assert whole.text == "".join(c.text for c in chunks)
    with pytest.raises(AgentError, match="reply_compression") as refused:
        generate(client, "gpt2", {"prompt": "hi"}, reply_compression="gzip")
    assert refused.value.code == "bad_request"


@pytest.mark.parametrize(
    ("model", "arch"), [("llama_batched", "llama"), ("gpt2_merged_batched", "gpt2_merged")]
)
def test_batched_requests_run_in_lock_step_and_get_their_own_tokens(
    agent_client: tuple[Agent, AgentClient], model: str, arch: str
) -> None:
    """Three prompts of different lengths and limits queued together: one run, the shorter
    caches left-padded; each request's greedy tokens and text as alone, each its own end
    (the merged export's rows on its cache branch together)."""
    agent, client = agent_client
    cases = REFERENCE["models"][arch]
    limits = [N, 5, 13]  # rows leave the batch at different steps
    replies = [
        client.request(
            model,
            {"prompt": case["prompt"]},
            params={"max_new_tokens": n},
            timeout=30,
        )
        for case, n in zip(cases, limits, strict=True)
    ]
    for case, n, reply in zip(cases, limits, replies, strict=True):
        chunks = list(reply)
        assert tokens_of(chunks) == case["greedy"][:n]
        assert "".join(c.text for c in chunks) == codec_text(case["greedy"][:n])
        assert reply.end.finish_reason == "length"
        assert reply.end.usage == {"prompt_tokens": len(case["ids"]), "completion_tokens": n}
    samples = agent.metrics.registry.get_sample_value
    runs = samples("edge_agent_batch_requests_count", {"model": model})
    requests = samples("edge_agent_batch_requests_sum", {"model": model})
    assert (runs, requests) == (1, 3)  # all three in one run


def codec_text(tokens: list[int]) -> str:
    """The fixture tokenizer's decode of `tokens` (what the chunks' text adds up to)."""
    codec = open_tokenizer(DECODERS / "llama")
    assert codec is not None
    return codec.decode(tokens)
