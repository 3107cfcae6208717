"""`edge-agent`'s client commands: models | request | subscribe, run against an agent over the
broker (where and how they connect: the flags, else the agent's own config, `-c`)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from agent.cli_values import describe_outputs, parse_inputs, parse_params
from agent.config import AgentConfig, ConfigError, load_config

__all__ = ["cmd_models", "cmd_request", "cmd_subscribe", "load_or_exit"]


def load_or_exit(args: argparse.Namespace) -> AgentConfig:
    """The config `-c` names (defaults without one); its problems printed, exit 2."""
    try:
        return load_config(Path(args.config) if args.config else None)
    except ConfigError as e:
        for problem in e.problems:
            print(f"error: {problem}", file=sys.stderr)
        raise SystemExit(2) from None


def _client_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Where and how the client connects: the flags, else the agent's config (`-c`), whose
    username, password file and TLS files it uses as the agent does."""
    from agent.mqtt.reconnect import credentials, tls_context

    config = load_or_exit(args) if args.config else None
    settings: dict[str, Any] = {
        "host": args.host or (config.mqtt.host if config else "127.0.0.1"),
        "port": args.port or (config.mqtt.port if config else 1883),
        "device_id": args.device or (config.device_id if config else "demo"),
        "topic_prefix": args.prefix or (config.mqtt.topic_prefix if config else "edge"),
        "protocol": args.protocol or (config.mqtt.protocol if config else "5"),
    }
    if config is not None:
        settings["tls"] = tls_context(config.mqtt)
        settings["username"], settings["password"] = credentials(config.mqtt)
    return settings


def _connect(args: argparse.Namespace) -> Any:
    from agent.client import AgentClient

    settings: dict[str, Any] = {}
    try:
        settings = _client_settings(args)
        return AgentClient(**settings).connect()
    except (ConnectionError, OSError) as e:
        where = f" ({settings['host']}:{settings['port']})" if settings else ""
        print(f"error: {e}{where}", file=sys.stderr)
        raise SystemExit(1) from None


def cmd_request(args: argparse.Namespace) -> int:
    from agent.client import AgentError

    inputs = parse_inputs(args.input, args.text, args.message)
    client = _connect(args)
    try:
        reply = client.request(
            args.model,
            inputs,
            stream=not args.no_stream,
            params=parse_params(args.param),
            priority=args.priority,
            version=args.version,
            timeout=args.timeout,
            compress=args.compress,
        )
        first = None
        try:
            for chunk in reply:
                ms = (chunk.received - reply.sent_at) * 1000
                first = first if first is not None else ms
                print(
                    f"{ms:9.2f} ms  chunk seq={chunk.seq} index={chunk.index} v{chunk.version}  "
                    f"{describe_outputs(chunk.outputs)}"
                    + (f"  text={chunk.text!r}" if chunk.text is not None else ""),
                    flush=True,
                )
        except AgentError as e:
            print(f"error {e.code}: {e.message}", file=sys.stderr)
            return 1
        total = (time.perf_counter() - reply.sent_at) * 1000
        if reply.result is not None:
            print(f"{total:9.2f} ms  result v{reply.version}  {describe_outputs(reply.result)}")
        elif reply.end is not None:
            end, why = reply.end, reply.end.finish_reason
            print(
                f"{total:9.2f} ms  end chunks={end.chunks}"
                + (f"  {why} {end.usage}" if why else "")
                + (f"  language={end.language}" if end.language else "")
            )
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
    kind = message.get("type") or message.get("state") or topic.rsplit("/", 1)[-1]
    keep = {k: v for k, v in message.items() if k not in ("outputs", "data", "v", "ts")}
    if "outputs" in message:
        from agent.client import decode_outputs

        try:
            keep["outputs"] = describe_outputs(decode_outputs(message["outputs"]))
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
        from agent.models.repository import scan_repository

        config = load_or_exit(args)
        if not config.models.repository.is_dir():
            print(
                f"error: models.repository: folder not found: {config.models.repository}",
                file=sys.stderr,
            )
            return 2
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
    as_json = args.json if args.json is not None else not sys.stdout.isatty()
    if as_json:
        print(json.dumps(inventory, indent=2, default=str))
    else:
        from agent.models.records import format_inventory

        print(format_inventory(inventory))
    return 0
