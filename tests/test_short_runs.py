"""Short requests run on the network thread: which ones (agent.inference.short_runs), the
scheduler's slot they take, and the whole path against a real Mosquitto and real ONNX models."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import onnxruntime as ort

from agent.demo import models as demo_models
from agent.inference.scheduler import Scheduler
from agent.inference.short_runs import MAX_MESSAGES, ShortRuns
from tests.ops_helpers import wait_until


def test_a_model_is_short_only_once_seen_on_that_version_and_fast():
    runs = ShortRuns(max_s=0.001)
    assert not runs.is_short("m", 1, 100)  # never seen: its first requests go to a worker
    runs.record("m", 1, 0.0002, 1, 100)
    assert runs.is_short("m", 1, 100)
    assert not runs.is_short("m", 2, 100)  # a new version is measured again
    assert not runs.is_short("other", 1, 100)
    runs.record("m", 2, 0.0002, 1, 100)
    assert runs.is_short("m", 2, 100) and not runs.is_short("m", 1, 100)


def test_one_slow_request_counts_at_once_and_fast_ones_bring_it_back_slowly():
    runs = ShortRuns(max_s=0.001)
    runs.record("m", 1, 0.0001, 1, 100)
    runs.record("m", 1, 0.005, 1, 100)  # a slow one: not short from now on
    assert not runs.is_short("m", 1, 100)
    for _ in range(5):
        runs.record("m", 1, 0.0001, 1, 100)
    assert not runs.is_short("m", 1, 100)  # a few fast ones are not enough
    for _ in range(20):
        runs.record("m", 1, 0.0001, 1, 100)
    assert runs.is_short("m", 1, 100)


def test_larger_payloads_scale_the_expected_time_and_many_messages_never_qualify():
    runs = ShortRuns(max_s=0.001)
    runs.record("m", 1, 0.0004, 1, 1000)
    assert runs.is_short("m", 1, 2000)  # twice the input: 0.8 ms expected
    assert not runs.is_short("m", 1, 3000)  # three times: 1.2 ms
    runs.record("chatty", 1, 0.0001, MAX_MESSAGES + 1, 100)
    assert not runs.is_short("chatty", 1, 100)
    off = ShortRuns(max_s=0.0)
    off.record("m", 1, 0.0, 1, 100)
    assert not off.is_short("m", 1, 100)


def test_run_here_runs_on_the_caller_only_when_idle_and_keeps_the_worker_bound():
    started: list[tuple[str, str]] = []
    gate = threading.Event()
    running = threading.Event()

    def execute(job: str, queued_s: float) -> None:
        started.append((job, threading.current_thread().name))
        if job == "hold":
            running.set()
            gate.wait(5)

    scheduler: Scheduler[str] = Scheduler(
        workers=1, queue_size=4, execute=execute, expire=lambda j: None, cancel=lambda j: None
    )
    scheduler.start()
    try:
        assert scheduler.run_here("first")
        assert started == [("first", threading.current_thread().name)]

        # The only slot taken by a job run here: a queued job waits for it, and nothing else
        # runs here meanwhile (it would overtake the queued one).
        holder = threading.Thread(target=scheduler.run_here, args=("hold",), name="holder")
        holder.start()
        assert running.wait(5)
        assert scheduler.submit("queued", 4)
        assert not scheduler.run_here("overtaker")
        time.sleep(0.1)
        assert [job for job, _ in started] == ["first", "hold"]  # "queued" waits for the slot
        gate.set()
        holder.join(5)
        deadline = time.monotonic() + 5
        while len(started) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert started[2] == ("queued", "infer-worker-0")
    finally:
        gate.set()
        scheduler.stop(2)
    assert not scheduler.run_here("after stop")


def test_short_requests_run_on_the_network_thread_with_the_same_answers(
    broker, repository, make_agent, make_client
):
    # A generous bound, so a slow CI machine still counts the classifier as short.
    agent = make_agent(broker, repository, "[scheduler]\ninline_max_ms = 50\n")
    client = make_client(broker, agent)
    session = ort.InferenceSession(demo_models.to_bytes(demo_models.conv_net()))
    rng = np.random.default_rng(5)
    for _ in range(20):
        image = rng.standard_normal((1, 3, 32, 32)).astype(np.float32)
        scores = client.infer("classifier", {"image": image})["scores"]
        np.testing.assert_allclose(scores, session.run(None, {"image": image})[0], rtol=1e-5)
    # A worker's reply can reach the client before the worker counts the request done.
    assert wait_until(lambda: agent.telemetry()["counters"].get("requests_ok") == 20)
    counters = agent.telemetry()["counters"]
    assert counters.get("requests_inline", 0) >= 10  # all but the first few

    # Steps models choose their run count per request: always a worker's job.
    for _ in range(3):
        client.infer("decoder", {"token": np.array([[1]], dtype=np.int64)}, params={"max_steps": 2})
    assert agent.telemetry()["counters"].get("requests_inline", 0) == counters["requests_inline"]


def test_with_inline_max_ms_zero_every_request_goes_to_a_worker_until_a_reload(
    broker, repository, make_agent, make_client
):
    agent = make_agent(broker, repository, "[scheduler]\ninline_max_ms = 0\n")
    client = make_client(broker, agent)
    image = np.zeros((1, 3, 32, 32), np.float32)
    for _ in range(10):
        client.infer("classifier", {"image": image})
    assert wait_until(lambda: agent.telemetry()["counters"].get("requests_ok") == 10)
    assert "requests_inline" not in agent.telemetry()["counters"]

    # A reload (SIGHUP) turns it on for the next request.
    config = agent.config
    scheduler = config.scheduler.model_copy(update={"inline_max_ms": 50.0})
    report = agent.reload(config.model_copy(update={"scheduler": scheduler}))
    assert report.applied == ["scheduler.inline_max_ms"] and not report.restart_required
    for _ in range(5):
        client.infer("classifier", {"image": image})
    assert agent.telemetry()["counters"].get("requests_inline", 0) >= 1


def test_stop_waits_for_a_job_run_here():
    finished = threading.Event()
    running = threading.Event()

    def execute(job: str, queued_s: float) -> None:
        running.set()
        time.sleep(0.3)
        finished.set()

    scheduler: Scheduler[str] = Scheduler(
        workers=2, queue_size=4, execute=execute, expire=lambda j: None, cancel=lambda j: None
    )
    scheduler.start()
    holder = threading.Thread(target=scheduler.run_here, args=("job",), name="holder")
    holder.start()
    assert running.wait(5)
    scheduler.stop(5)
    assert finished.is_set()  # its reply is out before the agent closes the connection
    holder.join(5)


def test_a_request_run_on_the_network_thread_never_waits_for_room_only_it_makes(
    broker, repository, make_agent, make_client, monkeypatch
):
    """A short request passes the room check, then workers' streams fill a small spool
    (`reject_new`) before it puts its reply: waiting there, on the thread that holds the
    connection, nobody would read the acknowledgements that free the room. Its reply is put
    at once instead; the check's start is slowed here to widen that gap."""
    run_here = Scheduler.run_here

    def slowly(self: Scheduler, job: object) -> bool:
        time.sleep(0.03)  # the workers run meanwhile
        return run_here(self, job)

    monkeypatch.setattr(Scheduler, "run_here", slowly)
    agent = make_agent(
        broker, repository, "[scheduler]\ninline_max_ms = 50\n[spool]\nmax_messages = 16\n"
    )
    client = make_client(broker, agent)
    image = np.zeros((1, 3, 32, 32), np.float32)
    token = {"token": np.array([[1]], dtype=np.int64)}
    stop = threading.Event()
    failures: list[Exception] = []

    def keep_asking(ask: Callable[[], object]) -> None:
        while not stop.is_set():
            try:
                ask()
            except Exception as e:  # a request stuck past its timeout
                failures.append(e)
                return

    asks = [lambda: client.infer("decoder", token, params={"max_steps": 32}, timeout=10)]
    asks += [lambda: client.infer("classifier", {"image": image}, timeout=10)] * 3
    threads = [threading.Thread(target=keep_asking, args=(ask,)) for ask in asks]
    for thread in threads:
        thread.start()
    time.sleep(4)
    stop.set()
    for thread in threads:
        thread.join(15)
    assert not failures
    assert agent.telemetry()["counters"].get("requests_inline", 0) >= 1
    client.infer("classifier", {"image": image}, timeout=10)
