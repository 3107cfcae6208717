"""Dynamic batching: requests queued together run as one batch, each streaming its own replies.

Against a real Mosquitto and real ONNX models; the batches are made deterministic by a long
`max_queue_delay_us` and by queuing every request before the first one can start.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from agent.client.reply import AgentError
from agent.demo import models as demo_models
from agent.demo.run import DECODER_CONFIG
from agent.inference import batching
from agent.inference.scheduler import BatchSpec, Scheduler
from agent.models.model_config import ModelConfigError, parse_model_config
from tests.conftest import decoder_reference

BATCHING = "[batching]\nmax_batch = 64\nmax_queue_delay_us = 150000\n"
COUNTDOWN_STEPS = """\
[stream]
mode = "steps"
max_steps = 32
feed = { token = "next_token" }
stop = { output = "next_token", value = 0 }
"""


def countdown() -> onnx.ModelProto:
    """next_token = token - 1: a stream starting at n stops after n steps (at 0)."""
    one = helper.make_tensor("one", TensorProto.INT64, [], [1])
    graph = helper.make_graph(
        [helper.make_node("Sub", ["token", "one"], ["next_token"])],
        "countdown",
        [helper.make_tensor_value_info("token", TensorProto.INT64, ["batch", 1])],
        [helper.make_tensor_value_info("next_token", TensorProto.INT64, ["batch", 1])],
        [one],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def write_models(root: Path) -> Path:
    def add(name: str, model: onnx.ModelProto, config: str) -> None:
        (root / name / "1").mkdir(parents=True)
        demo_models.save(model, root / name / "1" / "model.onnx")
        (root / name / "config.toml").write_text(config)

    add("mlp", demo_models.mlp(), BATCHING)
    add("decoder", demo_models.gru_decoder(), DECODER_CONFIG.format(steps=32) + BATCHING)
    add("countdown", countdown(), COUNTDOWN_STEPS + BATCHING)
    add("fixed", fixed_batch_mlp(), BATCHING)  # a batch axis of fixed size 1: refused
    return root


def fixed_batch_mlp() -> onnx.ModelProto:
    model = demo_models.mlp()
    for value in (*model.graph.input, *model.graph.output):
        value.type.tensor_type.shape.dim[0].dim_value = 1
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_models(tmp_path_factory.mktemp("batching-models"))


def batches_run(agent, model: str) -> tuple[int, float]:
    """(batched runs, requests in them) from the agent's histogram."""
    samples = agent.metrics.registry.get_sample_value
    count = samples("edge_agent_batch_requests_count", {"model": model}) or 0
    total = samples("edge_agent_batch_requests_sum", {"model": model}) or 0
    return int(count), total


def test_whole_requests_run_as_one_batch_and_each_gets_its_rows(
    broker, models, make_agent, make_client
):
    agent = make_agent(broker, models)
    client = make_client(broker, agent)
    rng = np.random.default_rng(3)
    inputs = [rng.standard_normal((1 + n % 3, 16)).astype(np.float32) for n in range(12)]
    replies = [client.request("mlp", {"x": x}, stream=n % 2 == 0) for n, x in enumerate(inputs)]
    session = ort.InferenceSession(demo_models.to_bytes(demo_models.mlp()))
    for n, (x, reply) in enumerate(zip(inputs, replies, strict=True)):
        got = reply.collect()
        (want,) = session.run(None, {"x": x})
        np.testing.assert_allclose(got["y"], want, rtol=1e-5, atol=1e-6)
        if n % 2 == 0:
            assert reply.end is not None and reply.end.chunks == 1
    runs, requests = batches_run(agent, "mlp")
    assert requests == len(inputs) and runs < len(inputs)  # they shared runs
    # Counted per run, once for all its requests: each request still counts once.
    sample = agent.metrics.registry.get_sample_value
    ok = {"model": "mlp", "version": "1", "outcome": "ok"}
    assert sample("edge_agent_requests_total", ok) == len(inputs)
    for histogram in ("queue_seconds", "inference_seconds", "request_duration_seconds"):
        assert sample(f"edge_agent_{histogram}_count", {"model": "mlp"}) == len(inputs)
    assert sample("edge_agent_chunks_published_total", {"model": "mlp"}) == len(inputs) // 2
    assert agent.counters["requests_ok"] == len(inputs)


def test_decoder_streams_batched_in_lock_step_match_single_runs(
    broker, models, make_agent, make_client
):
    agent = make_agent(broker, models)
    client = make_client(broker, agent)
    steps = [32, 5, 17, 1, 32, 9]
    starts = [1, 4, 7, 2, 9, 3]
    replies = [
        client.request(
            "decoder",
            {"token": np.array([[t]], dtype=np.int64)},
            params={"max_steps": n},
            stream=n != 17,
        )
        for n, t in zip(steps, starts, strict=True)
    ]
    for n, t, reply in zip(steps, starts, replies, strict=True):
        expected = decoder_reference(n, token=t)
        if n == 17:  # stream: false, the steps stacked on a new leading axis
            np.testing.assert_array_equal(reply.collect()["next_token"], np.stack(expected))
            continue
        chunks = list(reply)
        assert [c.index for c in chunks] == list(range(n))
        for chunk, want in zip(chunks, expected, strict=True):
            np.testing.assert_array_equal(chunk.outputs["next_token"], want)
        assert reply.end is not None and reply.end.chunks == n
    runs, requests = batches_run(agent, "decoder")
    assert requests == len(steps) and runs < len(steps)


def test_each_request_stops_on_its_own_rows(broker, models, make_agent, make_client):
    agent = make_agent(broker, models)
    client = make_client(broker, agent)
    starts = [3, 7, 5, 1, 12]
    replies = [
        client.request("countdown", {"token": np.array([[t]], dtype=np.int64)}) for t in starts
    ]
    two = client.request(
        "countdown", {"token": np.array([[9], [20]], dtype=np.int64)}, params={"max_steps": 2}
    )
    for t, reply in zip(starts, replies, strict=True):
        tokens = [int(c.outputs["next_token"][0, 0]) for c in reply]
        assert tokens == list(range(t - 1, -1, -1))  # down to 0, then the stream ends
    chunks = list(two)  # two rows of one request: max_steps bounds it, one row reaching 0 not
    assert [c.outputs["next_token"].ravel().tolist() for c in chunks] == [[8, 19], [7, 18]]


def test_a_model_without_a_batch_axis_cannot_batch(broker, models, make_agent, make_client):
    agent = make_agent(broker, models)
    versions = agent.models.inventory()["models"]["fixed"]["versions"]
    assert versions["1"]["state"] == "failed"
    assert "symbolic leading axis" in versions["1"]["error"]
    with pytest.raises(ModelConfigError, match="batching applies to"):
        parse_model_config('[stream]\nmode = "batch"\n[batching]\nmax_batch = 8\n', "x.toml")


def test_scheduler_gathers_jobs_of_one_key_within_the_delay():
    ran: list[object] = []
    gate = threading.Event()

    def execute(job: object, queued: float) -> None:
        if job == "gate":
            gate.wait(5)
        ran.append(job)

    def execute_batch(jobs: list[tuple[object, float]]) -> None:
        ran.append(tuple(job for job, _ in jobs))

    scheduler: Scheduler[object] = Scheduler(
        workers=1,
        queue_size=64,
        execute=execute,
        expire=lambda job: ran.append(("expired", job)),
        cancel=lambda job: None,
        execute_batch=execute_batch,
    )
    scheduler.start()
    assert scheduler.submit("gate", 9)
    time.sleep(0.05)  # the only worker holds the gate
    spec = BatchSpec("m", rows=1, max_rows=3, delay_s=0.3)
    for name in ("a", "b", "c", "d"):
        assert scheduler.submit(name, 4, batch=spec)
    assert scheduler.submit("other", 4, batch=BatchSpec("n", 1, 3, 0.0))
    gate.set()
    deadline = time.monotonic() + 3
    while len(ran) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    # a, b, c fill a batch at once; d is left alone and waits up to 0.3 s for company
    assert ran[:2] == ["gate", ("a", "b", "c")]
    time.sleep(0.1)
    assert scheduler.submit("e", 4, batch=spec)  # joins d's batch while it waits
    deadline = time.monotonic() + 3
    while len(ran) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    scheduler.stop(2)
    assert ran[2:] == ["other", ("d", "e")] or ran[2:] == [("d", "e"), "other"]


def _batch_scheduler(ran: list[object]) -> Scheduler[object]:
    scheduler: Scheduler[object] = Scheduler(
        workers=2,
        queue_size=64,
        execute=lambda job, queued: ran.append(job),
        expire=lambda job: None,
        cancel=lambda job: None,
        execute_batch=lambda jobs: ran.append(tuple(job for job, _ in jobs)),
    )
    scheduler.start()
    return scheduler


def test_a_batch_filled_by_later_submissions_runs_at_once_not_after_its_delay():
    ran: list[object] = []
    scheduler = _batch_scheduler(ran)
    spec = BatchSpec("m", rows=1, max_rows=3, delay_s=30.0)
    started = time.monotonic()
    for name in ("a", "b", "c"):
        assert scheduler.submit(name, 4, batch=spec)
        time.sleep(0.05)  # each joins the batch its worker is collecting
    while not ran and time.monotonic() - started < 10:
        time.sleep(0.01)
    assert ran == [("a", "b", "c")]
    assert time.monotonic() - started < 10  # woken by the last join, not by the 30 s delay
    scheduler.stop(2)


def test_stopping_ends_a_batch_that_is_still_collecting():
    ran: list[object] = []
    scheduler = _batch_scheduler(ran)
    assert scheduler.submit("a", 4, batch=BatchSpec("m", rows=1, max_rows=8, delay_s=30.0))
    time.sleep(0.1)
    started = time.monotonic()
    scheduler.stop(10)
    assert time.monotonic() - started < 5
    assert ran == ["a"]


def test_groups_keep_requests_whose_inputs_cannot_be_joined_apart():
    a = {"x": np.zeros((1, 4), np.float32)}
    b = {"x": np.zeros((2, 4), np.float32)}
    c = {"x": np.zeros((1, 5), np.float32)}
    d = {"x": np.zeros((1, 4), np.float64)}
    assert batching.groups([a, b, c, d]) == [[0, 1], [2], [3]]
    joined = batching.join([a, b])
    assert joined["x"].shape == (3, 4)
    parts = batching.split({"y": np.arange(3)}, [1, 2])
    assert [p["y"].tolist() for p in parts] == [[0], [1, 2]]


def test_a_request_the_model_cannot_run_fails_alone_not_its_batch(
    broker, models, make_agent, make_client
):
    """A token out of the embedding's range fails a joined run before it sends anything: its
    requests run again each on its own, so only that one gets `model_error`."""
    agent = make_agent(broker, models)
    client = make_client(broker, agent)
    starts = [1, 2**40, 4, 7]
    replies = [
        client.request(
            "decoder", {"token": np.array([[t]], dtype=np.int64)}, params={"max_steps": 3}
        )
        for t in starts
    ]
    for t, reply in zip(starts, replies, strict=True):
        if t == 2**40:
            with pytest.raises(AgentError) as raised:
                list(reply)
            assert raised.value.code == "model_error"
            continue
        chunks = list(reply)
        expected = decoder_reference(3, token=t)
        for chunk, want in zip(chunks, expected, strict=True):
            np.testing.assert_array_equal(chunk.outputs["next_token"], want)
    runs, requests = batches_run(agent, "decoder")
    assert runs >= 1 and requests >= 2  # the first run joined them
    assert agent.counters["requests_ok"] == 3
