"""`ROOT/cancel` for every mode: a running generate stream and a running `steps` stream end
within a step with `end` `finish_reason: "cancelled"`; a queued request ends without running;
unknown ids and malformed cancels change nothing."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.client import AgentClient
from agent.demo.broker import EmbeddedBroker
from agent.protocol.payload import encode_payload
from agent.service.agent import Agent
from tests.conftest import agent_config, serve_agent, write_long_decoder
from tests.generate_helpers import REFERENCE, write_decoder

LONG = "[generate]\ncontext = 4096\nmax_new_tokens = 4000\n"  # rotary: any length runs
ENDLESS_EOS = 383  # an eos its greedy tokens never reach in 4000


@pytest.fixture(scope="module")
def one_worker(
    broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Agent, AgentClient]]:
    tmp = tmp_path_factory.mktemp("cancel")
    root = write_long_decoder(tmp / "models")
    write_decoder(root, "llama", "llama", LONG)
    write_decoder(root, "endless", "llama", LONG + f"eos = [{ENDLESS_EOS}]\n")
    yield from serve_agent(broker, agent_config(tmp, broker, root, SCHEDULER__WORKERS="1"), 20)


def test_a_running_generation_is_cancelled(one_worker: tuple[Agent, AgentClient]) -> None:
    _, client = one_worker
    ref = REFERENCE["models"]["llama"][0]
    reply = client.request("llama", {"prompt": ref["prompt"]}, request_id="gen-c1", timeout=60)
    tokens: list[int] = []
    for chunk in reply:
        if not tokens:
            client.cancel("gen-c1")
        tokens.extend(int(t) for t in chunk.outputs["tokens"])
    assert reply.end is not None and reply.end.finish_reason == "cancelled"
    assert 1 <= len(tokens) < 4000
    assert tokens[:24] == ref["greedy"][: len(tokens[:24])]
    assert reply.end.usage == {"prompt_tokens": len(ref["ids"]), "completion_tokens": len(tokens)}


def test_a_generation_not_streamed_ends_with_end_when_cancelled(
    one_worker: tuple[Agent, AgentClient],
) -> None:
    """As every mode's `stream: false` does (it used to be a `result` of the tokens so far)."""
    _, client = one_worker
    ref = REFERENCE["models"]["llama"][0]
    reply = client.request(
        "endless", {"prompt": ref["prompt"]}, request_id="gen-c2", stream=False, timeout=60
    )
    time.sleep(0.3)  # running: 4000 tokens take seconds
    client.cancel("gen-c2")
    assert list(reply) == []
    assert reply.result is None
    assert reply.end is not None and reply.end.finish_reason == "cancelled"
    assert reply.end.usage is not None and reply.end.usage["completion_tokens"] >= 1


def test_a_running_steps_stream_is_cancelled(one_worker: tuple[Agent, AgentClient]) -> None:
    _, client = one_worker
    reply = client.request(
        "decoder", {"token": np.array([[1]], np.int64)}, request_id="steps-c1", timeout=60
    )
    count = 0
    for _ in reply:
        if count == 0:
            client.cancel("steps-c1")
        count += 1
    assert reply.end is not None and reply.end.finish_reason == "cancelled"
    assert 1 <= count < 5000 and reply.end.chunks == count


def test_a_queued_request_ends_without_running(one_worker: tuple[Agent, AgentClient]) -> None:
    _, client = one_worker
    running = client.request(
        "decoder", {"token": np.array([[1]], np.int64)}, request_id="steps-c2", timeout=60
    )
    stream = iter(running)  # one iterator: a dropped one closes the reply
    next(stream)  # the only worker is busy with it
    queued = client.request("llama", {"prompt": "queued"}, request_id="gen-c2", timeout=60)
    client.cancel("gen-c2")
    client.cancel("steps-c2")
    list(stream)
    assert running.end is not None and running.end.finish_reason == "cancelled"
    assert list(queued) == []  # it could only start once the other one ended
    assert queued.end is not None and queued.end.finish_reason == "cancelled"
    assert queued.end.chunks == 0


def test_unknown_and_malformed_cancels_change_nothing(
    one_worker: tuple[Agent, AgentClient], tmp_path: Path
) -> None:
    _agent, client = one_worker
    client.cancel("no-such-request")
    client.publish_raw(f"{client.root}/cancel", b"\xa1\x62id\x01", 1)  # {id: 1}
    ref = REFERENCE["models"]["llama"][2]
    reply = client.request("llama", {"prompt": ref["prompt"]}, params={"max_new_tokens": 5})
    assert [int(t) for c in reply for t in c.outputs["tokens"]] == ref["greedy"][:5]
    assert reply.end is not None and reply.end.finish_reason == "length"


def test_a_cancel_ends_the_requests_of_that_id_under_every_model(
    one_worker: tuple[Agent, AgentClient],
) -> None:
    """One id may name a request of each model (their reply topics differ): a cancel of it
    ends them all, not only the latest."""
    _, client = one_worker
    running = client.request(
        "decoder", {"token": np.array([[1]], np.int64)}, request_id="both-c1", timeout=60
    )
    stream = iter(running)
    next(stream)  # the only worker is busy with it
    ends: queue.Queue[dict[str, Any]] = queue.Queue()
    client.listen(f"{client.root}/result/llama/both-c1", lambda t, m, raw: ends.put(m or {}))
    time.sleep(0.1)  # subscribed before the queued request can end
    body = {"id": "both-c1", "inputs": {"prompt": "queued"}}
    client.publish_raw(f"{client.root}/infer/llama", encode_payload(body), 1)
    time.sleep(0.2)  # queued behind the running one
    client.cancel("both-c1")
    list(stream)
    assert running.end is not None and running.end.finish_reason == "cancelled"
    end = ends.get(timeout=10)
    assert end["type"] == "end" and end["finish_reason"] == "cancelled"
