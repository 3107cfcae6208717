"""`edge-agent`: run | check-config | health | models | request | subscribe | build-engine | sign |
demo."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import queue
import signal
import sqlite3
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agent import __version__
from agent.cli_client import cmd_models, cmd_request, cmd_subscribe, load_or_exit
from agent.config import AgentConfig, ConfigError, load_config, masked_dict, to_toml
from agent.ops import logs
from agent.ops.logs import JsonFormatter, setup_logging

__all__ = ["JsonFormatter", "build_parser", "main", "setup_logging"]

log = logging.getLogger("agent")


def _positive_seconds(text: str) -> float:
    """An argparse type: seconds, more than 0 (argparse turns the ValueError into a usage
    error, not a traceback)."""
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


# -- run -----------------------------------------------------------------------------------


def _with_overrides(config: AgentConfig, args: argparse.Namespace) -> AgentConfig:
    """Command-line flags win over the file, on start and on every reload."""
    update = {"log_level": args.log_level, "log_format": args.log_format}
    return config.model_copy(update={k: v for k, v in update.items() if v is not None})


MALLOC_ARENAS = 2
_M_ARENA_MAX = -8  # glibc's mallopt parameter number


def limit_malloc_arenas(arenas: int = MALLOC_ARENAS) -> bool:
    """Cap glibc's malloc arenas for this long-running process with many threads. By default
    glibc lets threads use up to eight arenas a core, and the native allocations of SQLite and
    ONNX Runtime spread over them fragment: streaming through the spool, the agent's RSS crept
    by about 1 MB every 100,000 chunks without end, and stayed flat with two arenas
    (docs/operations.md). MALLOC_ARENA_MAX in the environment wins. True when applied."""
    if "MALLOC_ARENA_MAX" in os.environ or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    return bool(mallopt(_M_ARENA_MAX, arenas))


def cmd_run(args: argparse.Namespace) -> int:
    """SIGTERM/SIGINT: drain and stop, exit 0. SIGHUP: reload what is safe, report the rest."""
    limit_malloc_arenas()  # first: before the agent's threads make their arenas
    config = _with_overrides(load_or_exit(args), args)
    setup_logging(config.log_level, config.log_format, secrets=logs.config_secrets(config))
    from agent.ops.systemd import Notifier
    from agent.service.agent import Agent

    # The handler only queues: the main thread does the work, outside the signal context.
    signals: queue.SimpleQueue[int] = queue.SimpleQueue()

    def on_signal(signum: int, frame: Any) -> None:
        signals.put(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    # Unset, so that child processes (engine builds) never talk to systemd as us.
    notifier = Notifier.from_environ(unset=True)
    log.info(
        "edge-agent %s: device %s, broker %s:%d (MQTT %s), models %s",
        __version__,
        config.device_id,
        config.mqtt.host,
        config.mqtt.port,
        config.mqtt.protocol,
        config.models.repository,
    )
    agent = None
    try:
        agent = Agent(config, notifier=notifier)
        agent.start()
    except Exception as e:
        # Logged (so redacted), not raised: a raw traceback could carry a secret's path.
        if isinstance(e, OSError | ConnectionError | sqlite3.Error):
            log.error("cannot start: %s", e)  # an operator's problem (a full disk): no traceback
        else:
            log.exception("cannot start")
        if agent is not None:
            with contextlib.suppress(Exception):
                agent.stop()
        return 1
    try:
        while True:
            try:
                signum = signals.get(timeout=1.0)
            except queue.Empty:
                continue
            log.info("received %s", signal.Signals(signum).name)
            if signum != signal.SIGHUP:
                break
            _reload(agent, args)
    finally:
        agent.stop()
    return 0


def _reload(agent: Any, args: argparse.Namespace) -> None:
    """SIGHUP: the new configuration applied, or nothing of it; never the end of the run."""
    if args.config and _blank(Path(args.config)):  # an editor's truncate-then-write caught
        # halfway would otherwise put every reloadable key back to its default
        _reload_failed(agent, [f"{args.config}: the file is empty (being written?)"])
        return
    try:
        new = _with_overrides(load_config(Path(args.config) if args.config else None), args)
        logs.add_secrets(logs.config_secrets(new))
    except ConfigError as e:
        _reload_failed(agent, e.problems)
        return
    except Exception as e:  # anything else the file causes: logged (redacted), not raised
        _reload_failed(agent, [f"{type(e).__name__}: {e}"])
        return
    agent.reload(new)


def _blank(path: Path) -> bool:
    try:
        return not path.read_bytes().strip()
    except OSError:
        return False  # load_config says why


def _reload_failed(agent: Any, problems: list[str]) -> None:
    for problem in problems:
        log.error("reload: %s", problem)
    log.error("reload: the configuration has errors; still running with the previous one")
    agent.metrics.reloads.labels("failed").inc()
    agent.reporter.notifier.status("reload failed: still running the previous configuration")


def cmd_check_config(args: argparse.Namespace) -> int:
    """Validate (also as systemd's ExecStartPre): one line per problem, exit 2 on any."""
    config = load_or_exit(args)
    problems = []
    if not config.models.repository.is_dir():
        problems.append(f"models.repository: folder not found: {config.models.repository}")
    problems += _connection_file_problems(config)
    if not args.quiet:
        print(to_toml(masked_dict(config)))
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if config.mqtt.password_file is not None and config.mqtt.username is None:
        print("warning: mqtt.password_file is set without mqtt.username: not sent", file=sys.stderr)
    return 2 if problems else 0


def _connection_file_problems(config: Any) -> list[str]:
    """What `run` would fail on at its first connection: the TLS files as the agent loads
    them (a key that does not match its certificate, one with a passphrase, not PEM), the
    password file as it reads it (never its value)."""
    from agent.mqtt.reconnect import credentials, tls_context

    problems = []
    for load, prefix in ((tls_context, ""), (credentials, "mqtt.password_file: ")):
        try:
            load(config.mqtt)
        except ConnectionError as e:
            problems.append(f"{prefix}{e}")
    return problems


def cmd_health(args: argparse.Namespace) -> int:
    """Ask the running agent's `/healthz` (the container's HEALTHCHECK): 0 healthy, 1 not."""
    import urllib.error
    import urllib.request

    config = load_or_exit(args)
    metrics = config.metrics
    if not metrics.enabled or metrics.port == 0:
        print("error: [metrics] is off or on a random port: no /healthz to ask", file=sys.stderr)
        return 2
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(metrics.host, metrics.host)
    url = f"http://{f'[{host}]' if ':' in host else host}:{metrics.port}/healthz"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy
    try:
        with opener.open(url, timeout=args.timeout) as response:
            print(response.read().decode(errors="replace").strip())
            return 0
    except urllib.error.HTTPError as e:
        print(e.read().decode(errors="replace").strip())
        return 1
    except (urllib.error.URLError, OSError) as e:
        print(f"error: cannot reach {url}: {getattr(e, 'reason', e)}", file=sys.stderr)
        return 1


# -- demo -----------------------------------------------------------------------------------


def cmd_demo(args: argparse.Namespace) -> int:
    from agent.demo.run import run_demo

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
    check.add_argument("--quiet", "-q", action="store_true", help="print problems only")
    check.set_defaults(func=cmd_check_config)

    health = sub.add_parser("health", help="ask the running agent's /healthz (exit 0 = healthy)")
    health.add_argument("--config", "-c", help="TOML configuration file")
    health.add_argument("--timeout", type=_positive_seconds, default=3.0)
    health.set_defaults(func=cmd_health)

    def client_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", "-c", help="take broker and device from this agent config")
        p.add_argument("--host")
        p.add_argument("--port", type=int)
        p.add_argument("--device", help="device_id of the agent")
        p.add_argument("--prefix", help="topic prefix (default edge)")
        p.add_argument("--protocol", choices=["5", "3.1.1"])
        p.add_argument("--timeout", type=_positive_seconds, default=30.0)

    models = sub.add_parser("models", help="show the agent's model inventory")
    client_options(models)
    models.add_argument("--local", action="store_true", help="scan the repository on disk instead")
    shown = models.add_mutually_exclusive_group()
    shown.add_argument(
        "--json",
        action="store_true",
        default=None,
        help="print the raw inventory as JSON (the default when stdout is not a terminal)",
    )
    shown.add_argument(
        "--text",
        action="store_false",
        dest="json",
        default=None,
        help="print it for a person (the default on a terminal)",
    )
    models.set_defaults(func=cmd_models)

    request = sub.add_parser("request", help="send a request and print its stream live")
    client_options(request)
    request.add_argument("model")
    request.add_argument(
        "--input",
        "-i",
        action="append",
        default=[],
        metavar="NAME=FILE",
        help="an input: FILE.npy, the array NAME of FILE.npz, FILE.jpg|.png (its bytes), or "
        "FILE.wav (16 kHz PCM: its samples, float32)",
    )
    request.add_argument(
        "--text",
        "-t",
        action="append",
        default=[],
        metavar="NAME=TEXT",
        help="a text input (prompt, pair); a NAME given again: a string tensor of its texts",
    )
    request.add_argument(
        "--message",
        "-m",
        action="append",
        default=[],
        metavar="ROLE=TEXT",
        help="a message of a conversation, in order (inputs.messages of a chat model)",
    )
    request.add_argument("--compress", action="store_true", help="send the request as zstd")
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

    from agent.models import engine_builder

    build = sub.add_parser(
        "build-engine", help="build a TensorRT engine from ONNX as a new model version"
    )
    engine_builder.add_arguments(build)
    build.set_defaults(func=engine_builder.run_from_args)

    from agent import cli_sign

    sign = sub.add_parser("sign", help="write a version folder's model.sig (signed models)")
    cli_sign.add_arguments(sign)
    sign.set_defaults(func=cli_sign.run_from_args)

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
