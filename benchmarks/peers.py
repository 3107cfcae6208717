"""The baselines of the speed suite, each run as its own process (as the agent is).

    python -m benchmarks.peers raw   --port P --topic T --qos 1 --payload FILE --count N
    python -m benchmarks.peers naive --port P --topic T --model FILE --seconds S
    python -m benchmarks.peers echo  --port P --topic A --reply-topic B --payload FILE
    python -m benchmarks.peers load  --port P --root R --model M --payload FILE --seconds S

- raw: paho publishing one payload `count` times as fast as paho takes it (its own in-flight
  window of 64, the agent's default): the ceiling for a Python MQTT publisher.
- naive: the loop people write by hand: run the decoder step, `json.dumps` the token,
  publish at QoS 1, `wait_for_publish`, next.
- echo: republishes a fixed reply for every message it receives (the request/response round
  trip with no work in between).
- load: keeps `concurrency` requests outstanding against the agent (a new one the moment one
  finishes) and reports the completed requests per second. It is not a baseline but the
  driver of the batching figure, and it runs on benchmarks.lean_mqtt rather than paho: the
  driver should cost the shared machine little next to the agent it drives.

Every paho socket here sets TCP_NODELAY, as the agent's do, so each baseline is the strongest
plain paho gets. Results go to stdout as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import cbor2
import paho.mqtt.client as mqtt

from benchmarks.harness import connect, subscribe
from benchmarks.lean_mqtt import PUBLISH, LeanClient, parse_publish, puback

QUEUED = 60000  # QoS 1/2 messages handed to paho and not yet acknowledged, at most


def run_raw(args: argparse.Namespace) -> dict[str, Any]:
    payload = Path(args.payload).read_bytes()
    client = connect(args.port)
    started = time.perf_counter()
    infos: deque[mqtt.MQTTMessageInfo] = deque()
    for _ in range(args.count):
        if args.qos and len(infos) >= QUEUED:
            # Message ids are 16 bits: wait for the older half at once (not one by one, which
            # would hand the GIL back and forth with paho's thread on every message).
            for _ in range(QUEUED // 2):
                infos.popleft().wait_for_publish(60)
        infos.append(client.publish(args.topic, payload, args.qos))
    if args.qos:
        for info in infos:
            info.wait_for_publish(60)
    elapsed = time.perf_counter() - started
    client.disconnect()
    client.loop_stop()
    return {"published": args.count, "seconds": elapsed}


def run_naive(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    session = ort.InferenceSession(args.model, options, providers=["CPUExecutionProvider"])
    token = np.array([[1]], dtype=np.int64)
    h = np.zeros((1, args.hidden), np.float32)
    client = connect(args.port)
    steps = 0
    started = time.perf_counter()
    while time.perf_counter() - started < args.seconds:
        token, _logits, h = session.run(None, {"token": token, "h": h})
        client.publish(args.topic, json.dumps(token.tolist()), 1).wait_for_publish(10)
        steps += 1
    elapsed = time.perf_counter() - started
    client.disconnect()
    client.loop_stop()
    return {"steps": steps, "seconds": elapsed}


def run_echo(args: argparse.Namespace) -> dict[str, Any]:
    reply = Path(args.payload).read_bytes()
    client = connect(args.port)
    echoed = 0

    def on_message(c: mqtt.Client, userdata: Any, message: Any) -> None:
        nonlocal echoed
        c.publish(args.reply_topic, reply, 1)
        echoed += 1

    client.on_message = on_message
    subscribe(client, args.topic, 1)
    print(json.dumps({"ready": True}), flush=True)
    _wait_for_term()
    client.disconnect()
    client.loop_stop()
    return {"echoed": echoed}


def run_load(args: argparse.Namespace) -> dict[str, Any]:
    """Closed loop: `concurrency` requests in flight (QoS 1), each answered by one `result`
    message on its own reply topic; a reply (whatever its type) frees the slot for the next
    one. One thread on benchmarks.lean_mqtt, so that the load costs the machine little."""
    template = Path(args.payload).read_bytes()  # CBOR request with the id "REQUEST-ID-0000"
    marker = b"REQUEST-ID-0000"
    if template.count(marker) != 1:
        raise SystemExit("the load template must hold the id REQUEST-ID-0000 once")
    head, tail = template.split(marker)
    client = LeanClient("127.0.0.1", args.port, f"load-{os.getpid()}")
    client.subscribe(f"{args.root}/result/{args.model}/#", 1)
    topic = f"{args.root}/infer/{args.model}"
    counter = 0

    def request() -> bytes:
        nonlocal counter
        counter += 1
        return client.publish_packet(topic, b"%sL%014d%s" % (head, counter, tail), 1)

    client.sock.sendall(b"".join(request() for _ in range(args.concurrency)))
    completed = errors = 0
    now = time.perf_counter()
    started, end = now + args.warmup, now + args.warmup + args.seconds
    first: tuple[int, float] | None = None
    while now < end:
        out = []
        for kind, body in client.read(max(0.0, end - now)):
            if kind >> 4 != PUBLISH:
                continue  # PUBACKs of the requests, the only other packets
            mid, payload = parse_publish(kind, body)
            if mid is not None:
                out.append(puback(mid))
            if cbor2.loads(payload).get("type") == "error":
                errors += 1
            completed += 1
            out.append(request())
        if out:
            client.sock.sendall(b"".join(out))
        now = time.perf_counter()
        if first is None and now >= started:
            first = completed, now
    client.close()
    time.sleep(0.2)  # let what is in flight finish before the agent is asked anything else
    if first is None:
        return {"completed": 0, "seconds": 0.0, "errors": errors, "sent": counter}
    # `sent`: every request of the run, warm-up and the last ones in flight included.
    return {"completed": completed - first[0], "seconds": now - first[1], "errors": errors,
            "sent": counter}  # fmt: skip


def _wait_for_term() -> None:
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    signal.signal(signal.SIGINT, lambda *_: stopped.set())
    while not stopped.wait(0.2):
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="baseline peers of benchmarks/speed.py")
    sub = parser.add_subparsers(dest="mode", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--port", type=int, required=True)
    raw = sub.add_parser("raw", parents=[common])
    raw.add_argument("--topic", required=True)
    raw.add_argument("--qos", type=int, choices=(0, 1, 2), required=True)
    raw.add_argument("--payload", required=True)
    raw.add_argument("--count", type=int, required=True)
    naive = sub.add_parser("naive", parents=[common])
    naive.add_argument("--topic", required=True)
    naive.add_argument("--model", required=True)
    naive.add_argument("--hidden", type=int, required=True)
    naive.add_argument("--threads", type=int, default=1)
    naive.add_argument("--seconds", type=float, required=True)
    echo = sub.add_parser("echo", parents=[common])
    echo.add_argument("--topic", required=True)
    echo.add_argument("--reply-topic", required=True)
    echo.add_argument("--payload", required=True)
    load = sub.add_parser("load", parents=[common])
    load.add_argument("--root", required=True)
    load.add_argument("--model", required=True)
    load.add_argument("--payload", required=True)
    load.add_argument("--concurrency", type=int, default=64)
    load.add_argument("--warmup", type=float, default=1.0)
    load.add_argument("--seconds", type=float, required=True)
    args = parser.parse_args(argv)
    run = {"raw": run_raw, "naive": run_naive, "echo": run_echo, "load": run_load}[args.mode]
    print(json.dumps(run(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
