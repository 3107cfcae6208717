"""`edge-agent`: run | check-config | models | request | subscribe | demo."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from agent import __version__
from agent.backends.base import Array
from agent.config import AgentConfig, ConfigError, load_config, masked_dict, to_toml

log = logging.getLogger("agent")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: what journald and log shippers parse best."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "thread": record.threadName,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def setup_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(threadName)s] %(message)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("paho").setLevel(logging.WARNING)


def _load(args: argparse.Namespace) -> AgentConfig:
    try:
        return load_config(Path(args.config) if args.config else None)
    except ConfigError as e:
        for problem in e.problems:
            print(f"error: {problem}", file=sys.stderr)
        raise SystemExit(2) from None


# -- run -----------------------------------------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    config = _load(args)
    setup_logging(args.log_level or config.log_level, args.log_format or config.log_format)
    from agent.service import Agent

    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        log.info("received %s", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    agent = Agent(config)
    log.info(
        "edge-agent %s: device %s, broker %s:%d (MQTT %s), models %s",
        __version__,
        config.device_id,
        config.mqtt.host,
        config.mqtt.port,
        config.mqtt.protocol,
        config.models.repository,
    )
    agent.run_forever(stop)
    return 0


def cmd_check_config(args: argparse.Namespace) -> int:
    config = _load(args)
    problems = []
    if not config.models.repository.is_dir():
        problems.append(f"models.repository: folder not found: {config.models.repository}")
    tls = config.mqtt.tls
    for key, path in (
        ("ca_file", tls.ca_file),
        ("cert_file", tls.cert_file),
        ("key_file", tls.key_file),
    ):
        if tls.enabled and path is not None and not path.is_file():
            problems.append(f"mqtt.tls.{key}: file not found")
    if config.mqtt.password_file is not None and not config.mqtt.password_file.is_file():
        problems.append("mqtt.password_file: file not found")
    print(to_toml(masked_dict(config)))
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 2 if problems else 0


# -- client commands ---------------------------------------------------------------------------


def _client_settings(args: argparse.Namespace) -> dict[str, Any]:
    config = load_config(Path(args.config)) if args.config else None
    settings = {
        "host": args.host or (config.mqtt.host if config else "127.0.0.1"),
        "port": args.port or (config.mqtt.port if config else 1883),
        "device_id": args.device or (config.device_id if config else "demo"),
        "topic_prefix": args.prefix or (config.mqtt.topic_prefix if config else "edge"),
        "protocol": args.protocol or (config.mqtt.protocol if config else "5"),
    }
    return settings


def _connect(args: argparse.Namespace) -> Any:
    from agent.client import AgentClient

    try:
        return AgentClient(**_client_settings(args)).connect()
    except (ConnectionError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None


def _describe_outputs(outputs: dict[str, Array], width: int = 60) -> str:
    parts = []
    for name, value in outputs.items():
        text = np.array2string(value.reshape(-1)[:8], precision=4, separator=",")
        more = "…" if value.size > 8 else ""
        parts.append(f"{name}{list(value.shape)}={text[:width]}{more}")
    return " ".join(parts)


def _parse_inputs(specs: Sequence[str]) -> dict[str, Array]:
    inputs = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            raise SystemExit(f"error: --input needs NAME=FILE.npy, got {spec!r}")
        try:
            inputs[name] = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise SystemExit(f"error: cannot read {path}: {e}") from None
    return inputs


def _parse_params(specs: Sequence[str]) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for spec in specs:
        key, sep, raw = spec.partition("=")
        if not sep:
            raise SystemExit(f"error: --param needs KEY=VALUE, got {spec!r}")
        try:
            params[key] = json.loads(raw)
        except json.JSONDecodeError:
            params[key] = raw
    return params


def cmd_request(args: argparse.Namespace) -> int:
    from agent.client import AgentError

    inputs = _parse_inputs(args.input)
    client = _connect(args)
    try:
        reply = client.request(
            args.model,
            inputs,
            stream=not args.no_stream,
            params=_parse_params(args.param),
            priority=args.priority,
            version=args.version,
            timeout=args.timeout,
        )
        first = None
        try:
            for chunk in reply:
                ms = (chunk.received - reply.sent_at) * 1000
                first = first if first is not None else ms
                print(
                    f"{ms:9.2f} ms  chunk seq={chunk.seq} index={chunk.index} v{chunk.version}  "
                    f"{_describe_outputs(chunk.outputs)}",
                    flush=True,
                )
        except AgentError as e:
            print(f"error {e.code}: {e.message}", file=sys.stderr)
            return 1
        total = (time.perf_counter() - reply.sent_at) * 1000
        if reply.result is not None:
            print(f"{total:9.2f} ms  result v{reply.version}  {_describe_outputs(reply.result)}")
        elif reply.end is not None:
            print(f"{total:9.2f} ms  end chunks={reply.end.chunks}")
        print(
            f"timing (agent): {json.dumps(dict(reply.timing or {}))}"
            + (f"  first chunk {first:.2f} ms, last {total:.2f} ms" if first is not None else "")
        )
        if args.save:
            np.savez(args.save, **reply.collect() if reply.result is None else reply.result)
        return 0
    finally:
        client.close()


def _summarize_message(topic: str, message: dict[str, Any] | None) -> str:
    if message is None:
        return "(not CBOR)"
    kind = message.get("type") or message.get("state") or "?"
    keep = {k: v for k, v in message.items() if k not in ("outputs", "data", "v", "ts")}
    if "outputs" in message:
        from agent.client import decode_outputs

        try:
            keep["outputs"] = _describe_outputs(decode_outputs(message["outputs"]))
        except Exception as e:
            keep["outputs"] = f"(undecodable: {e})"
    if "data" in message:
        keep["data"] = f"{len(message['data'])} bytes"
    return f"{kind:<8} {json.dumps(keep, default=str)[:400]}"


def cmd_subscribe(args: argparse.Namespace) -> int:
    client = _connect(args)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *a: stop.set())
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    count = 0

    def show(topic: str, message: dict[str, Any] | None, raw: bytes) -> None:
        nonlocal count
        count += 1
        stamp = time.strftime("%H:%M:%S")
        print(f"{stamp} {topic}  {_summarize_message(topic, message)}", flush=True)
        if args.count and count >= args.count:
            stop.set()

    pattern = f"{client.root}/#"
    client.listen(pattern, show)
    print(f"listening on {pattern} (Ctrl-C to stop)", file=sys.stderr, flush=True)
    stop.wait(args.duration or None)
    client.close()
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    if args.local:
        from agent.repository import scan_repository

        config = _load(args)
        for name, info in sorted(scan_repository(config.models.repository).items()):
            problem = f"  config error: {info.config_error}" if info.config_error else ""
            print(f"{name}{problem}")
            for number, version in sorted(info.versions.items()):
                status = version.problem or "ok"
                print(f"  v{number}  {version.backend or '-':<12} {version.model_file}  {status}")
        return 0
    client = _connect(args)
    got = threading.Event()
    inventory: dict[str, Any] = {}

    def on_inventory(topic: str, message: dict[str, Any] | None, raw: bytes) -> None:
        if message is not None:
            inventory.update(message)
            got.set()

    client.listen(f"{client.root}/models", on_inventory)
    if not got.wait(args.timeout):
        print(f"error: no retained inventory on {client.root}/models", file=sys.stderr)
        client.close()
        return 1
    client.close()
    print(json.dumps(inventory, indent=2, default=str))
    return 0


# -- demo -----------------------------------------------------------------------------------


def cmd_demo(args: argparse.Namespace) -> int:
    from agent.demo import run_demo

    setup_logging(args.log_level, "text")
    return run_demo(host=args.host, port=args.port, steps=args.steps, repeats=args.repeats)


# -- parser ----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edge-agent", description=__doc__)
    parser.add_argument("--version", action="version", version=f"edge-agent {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the daemon")
    run.add_argument("--config", "-c", help="TOML configuration file")
    run.add_argument("--log-format", choices=["text", "json"])
    run.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    run.set_defaults(func=cmd_run)

    check = sub.add_parser("check-config", help="validate and print the effective configuration")
    check.add_argument("--config", "-c", help="TOML configuration file")
    check.set_defaults(func=cmd_check_config)

    def client_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", "-c", help="take broker and device from this agent config")
        p.add_argument("--host")
        p.add_argument("--port", type=int)
        p.add_argument("--device", help="device_id of the agent")
        p.add_argument("--prefix", help="topic prefix (default edge)")
        p.add_argument("--protocol", choices=["5", "3.1.1"])
        p.add_argument("--timeout", type=float, default=30.0)

    models = sub.add_parser("models", help="show the agent's model inventory")
    client_options(models)
    models.add_argument("--local", action="store_true", help="scan the repository on disk instead")
    models.set_defaults(func=cmd_models)

    request = sub.add_parser("request", help="send a request and print its stream live")
    client_options(request)
    request.add_argument("model")
    request.add_argument("--input", "-i", action="append", default=[], metavar="NAME=FILE.npy")
    request.add_argument("--param", "-p", action="append", default=[], metavar="KEY=VALUE")
    request.add_argument("--no-stream", action="store_true", help="ask for one result message")
    request.add_argument("--priority", type=int)
    request.add_argument("--version", type=int, dest="version")
    request.add_argument("--save", help="write the outputs to this .npz file")
    request.set_defaults(func=cmd_request)

    subscribe = sub.add_parser("subscribe", help="print every message of a device live")
    client_options(subscribe)
    subscribe.add_argument("--count", type=int, default=0, help="stop after N messages")
    subscribe.add_argument("--duration", type=float, default=0, help="stop after N seconds")
    subscribe.set_defaults(func=cmd_subscribe)

    demo = sub.add_parser("demo", help="end to end: agent, broker and a streaming decoder")
    demo.add_argument("--host", help="use this broker (default: start a private mosquitto)")
    demo.add_argument("--port", type=int, default=1883)
    demo.add_argument("--steps", type=int, default=32)
    demo.add_argument("--repeats", type=int, default=20)
    demo.add_argument("--log-level", default="warning")
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
