"""`limits.max_reply_bytes`: one request's replies are bounded; past the bound the stream ends
with one `too_large` error after the chunks already sent, and other requests are unaffected."""

from __future__ import annotations

import queue
import time
from pathlib import Path

import numpy as np
import pytest

from agent.client import AgentClient, AgentError
from agent.demo import models as demo_models
from agent.inference.reply_stream import ReplyStream, ReplyTooLarge
from tests.conftest import DECODER_CONFIG, MLP_CONFIG

BUDGET = 1024  # the smallest allowed: a decoder chunk is ~130 bytes, so ~7 of them
TERMINAL = ("end", "result", "error")


def listen(client: AgentClient, topic: str) -> queue.Queue[tuple[dict, int]]:
    """Every message on `topic`, decoded, with its payload size."""
    messages: queue.Queue[tuple[dict, int]] = queue.Queue()
    client.listen(topic, lambda t, m, raw: messages.put((m or {}, len(raw))))
    return messages


def until_terminal(messages: queue.Queue[tuple[dict, int]]) -> list[tuple[dict, int]]:
    """The messages up to the first terminal one (30 s at most), then whatever follows it
    within 0.3 s (there must be nothing)."""
    got: list[tuple[dict, int]] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (got and got[-1][0].get("type") in TERMINAL):
        try:
            got.append(messages.get(timeout=0.1))
        except queue.Empty:
            continue
    try:
        while True:
            got.append(messages.get(timeout=0.3))
    except queue.Empty:
        return got


def check_budget_stream(got: list[tuple[dict, int]], budget: int) -> list[dict]:
    """Chunks, then exactly one terminal `too_large` error; the chunks within the budget."""
    types = [m["type"] for m, _ in got]
    assert types[-1] == "error" and types.count("error") == 1, types
    assert set(types[:-1]) == {"chunk"}, types
    error = got[-1][0]
    assert error["code"] == "too_large" and "reply budget exceeded" in error["message"]
    assert [m["seq"] for m, _ in got] == list(range(len(got)))  # no gap where a chunk was held
    assert sum(size for _, size in got[:-1]) <= budget
    return [m for m, _ in got[:-1]]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """decoder (steps, batched in lock step) and mlp (batch mode)."""
    root = tmp_path_factory.mktemp("budget-models")
    (root / "decoder" / "1").mkdir(parents=True)
    demo_models.save(demo_models.gru_decoder(), root / "decoder" / "1" / "model.onnx")
    batching = "[batching]\nmax_batch = 8\nmax_queue_delay_us = 200000\n"
    (root / "decoder" / "config.toml").write_text(DECODER_CONFIG + batching)
    (root / "mlp" / "1").mkdir(parents=True)
    demo_models.save(demo_models.mlp(), root / "mlp" / "1" / "model.onnx")
    (root / "mlp" / "config.toml").write_text(MLP_CONFIG)
    return root


def test_a_stream_past_the_budget_ends_with_one_too_large_error(
    broker, repository, make_agent, make_client
):
    agent = make_agent(broker, repository, LIMITS__MAX_REPLY_BYTES=str(BUDGET))
    client = make_client(broker, agent)
    token = {"token": np.array([[1]], dtype=np.int64)}
    messages = listen(client, f"{agent.root}/result/decoder/big-1")
    reply = client.request("decoder", token, request_id="big-1")
    chunks = check_budget_stream(until_terminal(messages), BUDGET)
    assert 1 <= len(chunks) < 32
    assert [c["index"] for c in chunks] == list(range(len(chunks)))
    with pytest.raises(AgentError) as e:
        list(reply)
    assert e.value.code == "too_large"

    # A request under the budget, on the same agent, is not affected.
    small = client.request("decoder", token, params={"max_steps": 3})
    assert len(list(small)) == 3 and small.end is not None and small.end.chunks == 3
    assert agent.counters["requests_too_large"] == 1


def test_batch_mode_and_stream_false_are_bounded_too(broker, models, make_agent, make_client):
    agent = make_agent(broker, models, LIMITS__MAX_REPLY_BYTES=str(BUDGET))
    client = make_client(broker, agent)
    x = np.ones((256, 16), np.float32)  # 64 slices of 4 items: far more than the budget
    messages = listen(client, f"{agent.root}/result/mlp/slices-1")
    client.request("mlp", {"x": x}, request_id="slices-1")
    chunks = check_budget_stream(until_terminal(messages), BUDGET)
    assert [c["index"] for c in chunks] == [4 * k for k in range(len(chunks))]

    messages = listen(client, f"{agent.root}/result/mlp/whole-1")
    client.request("mlp", {"x": x}, request_id="whole-1", stream=False)
    got = until_terminal(messages)
    assert [m["type"] for m, _ in got] == ["error"] and got[0][0]["code"] == "too_large"

    small = client.request("mlp", {"x": x[:8]}, stream=False)
    assert small.collect()["y"].shape[0] == 8


def test_in_a_batch_only_the_request_past_the_budget_ends(broker, models, make_agent, make_client):
    agent = make_agent(broker, models, LIMITS__MAX_REPLY_BYTES=str(BUDGET))
    client = make_client(broker, agent)
    token = {"token": np.array([[1]], dtype=np.int64)}
    messages = listen(client, f"{agent.root}/result/decoder/long-1")
    long = client.request("decoder", token, request_id="long-1")
    shorts = [client.request("decoder", token, params={"max_steps": 4}) for _ in range(3)]
    check_budget_stream(until_terminal(messages), BUDGET)
    with pytest.raises(AgentError):
        list(long)
    for reply in shorts:
        assert len(list(reply)) == 4 and reply.end is not None
    batched = agent.metrics.registry.get_sample_value(
        "edge_agent_batch_requests_sum", {"model": "decoder"}
    )
    assert batched  # they ran together (the long one left the run, the others went on)


def test_a_refused_chunk_takes_no_number_and_the_error_gets_it():
    reply = ReplyStream(
        request_id="r",
        model="m",
        version=1,
        topic="t",
        qos=1,
        max_chunk_bytes=4096,
        max_reply_bytes=300,
    )
    outputs = {"y": np.zeros((1, 8), np.float32)}
    made = 0
    with pytest.raises(ReplyTooLarge):
        while True:
            reply.chunk(outputs, made)
            made += 1
    assert made >= 1 and reply.seq == made and reply.reply_bytes <= 300
    assert reply.error("too_large", "x")
    messages = reply.drain()
    assert [m.seq for m in messages] == list(range(made + 1))
