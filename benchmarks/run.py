#!/usr/bin/env python3
"""Benchmarks of the agent, measured side by side; results go to docs/benchmarks.md.

    python benchmarks/run.py                        # every section, full length (~5 min)
    python benchmarks/run.py --quick                # the speed targets, short: under a minute
    python benchmarks/run.py --quick --only hot-swap,drain   # other sections, short
    scripts/bench [ARGS]                            # any of these, installing what it needs first

Each section is measured in one run on one machine and saved to
`benchmarks/results/SECTION.json`; the report is written from every saved section, so running
one section keeps the others' last figures (each section says when it was measured). The
agent runs as its own process (`edge-agent run`), as on a box; the broker is a private
Mosquitto with `set_tcp_nodelay true`. `benchmarks/history.py` measures the speed section
against earlier commits (what each optimisation gained).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agent.client import AgentClient  # noqa: E402
from agent.demo.broker import EmbeddedBroker  # noqa: E402
from benchmarks import delivery, hot_swap, resend, speed  # noqa: E402
from benchmarks import sources as local_sources  # noqa: E402
from benchmarks.harness import AgentProcess, machine, versions, wait_online  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
SECTIONS = ("speed", "hot-swap", "resend", "drain", "sources")
PLOT = "benchmarks-speed.png"


def run_speed(broker: EmbeddedBroker, workdir: Path, quick: bool) -> dict[str, Any]:
    return speed.to_json(speed.measure(broker, workdir, quick))


def run_hot_swap(broker: EmbeddedBroker, workdir: Path, quick: bool) -> dict[str, Any]:
    repository = workdir / "swap-models"
    repository.mkdir()
    hot_swap.add_model(repository)
    with AgentProcess(workdir, broker, repository, device_id="bench-swap") as agent:
        wait_online(broker, agent.root, agent.started)
        with AgentClient(broker.host, broker.port, device_id=agent.device_id) as client:
            _wait_serving(client, hot_swap.MODEL)
            swap = hot_swap.measure_swaps(
                client, repository, seconds=3 if quick else 10, swaps=3 if quick else 8
            )
    print(f"hot swap: p99 {swap.p99_base_ms:.2f} -> {swap.p99_swap_ms:.2f} ms", flush=True)
    memory = hot_swap.measure_memory(workdir, cycles=50 if quick else 200)
    print(f"memory over {memory.cycles} cycles: {memory.growth_mb:+.1f} MB", flush=True)
    return {"swap": dataclasses.asdict(swap), "memory": dataclasses.asdict(memory)}


def run_resend(broker: EmbeddedBroker, workdir: Path, quick: bool) -> dict[str, Any]:
    repository = workdir / "resend-models"
    repository.mkdir()
    resend.add_model(repository)
    with AgentProcess(workdir, broker, repository, device_id="bench") as agent:
        wait_online(broker, agent.root, agent.started)
        with AgentClient(broker.host, broker.port, device_id=agent.device_id) as client:
            flood = resend.measure_flood(client, broker, agent.root, seconds=3 if quick else 10)
    print(f"resend flood: live p99 x{flood.ratio:.2f}", flush=True)
    return dataclasses.asdict(flood)


def run_drain(broker: EmbeddedBroker, workdir: Path, quick: bool) -> dict[str, Any]:
    repository = workdir / "drain-models"
    repository.mkdir()
    delivery.add_model(repository)
    with AgentProcess(workdir, broker, repository, device_id="bench") as agent:
        wait_online(broker, agent.root, agent.started)
        drain = delivery.measure_drain(
            broker, agent.root, outage_s=5 if quick else 30, window_s=3 if quick else 5
        )
    print(f"backlog drain: x{drain.ratio:.2f}", flush=True)
    return dataclasses.asdict(drain)


def run_sources(broker: EmbeddedBroker, workdir: Path, quick: bool) -> dict[str, Any]:
    return local_sources.to_json(local_sources.measure(broker, workdir, quick))


RUNNERS = {
    "speed": run_speed,
    "hot-swap": run_hot_swap,
    "resend": run_resend,
    "drain": run_drain,
    "sources": run_sources,
}


def _wait_serving(client: AgentClient, model: str, timeout: float = 60) -> None:
    import numpy as np

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            client.infer(model, {"x": np.zeros((1, 64), dtype=np.float32)}, timeout=2)
            return
        except Exception:
            time.sleep(0.2)
    raise RuntimeError(f"model {model} did not become ready")


# -- report -----------------------------------------------------------------------------------


def load_results() -> dict[str, dict[str, Any]]:
    found = {}
    for name in SECTIONS:
        path = RESULTS / f"{name}.json"
        if path.exists():
            found[name] = json.loads(path.read_text())
    return found


def measured_commit() -> str | None:
    """The commit whose agent is measured, `+changes` when `agent/` differs from it."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "status", "--porcelain", "--", "agent"],
            cwd=REPO,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:  # no git: a copy of the tree
        return None
    return (sha + ("+changes" if changed else "")) or None


def save_result(name: str, data: dict[str, Any], quick: bool) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    record = {
        "date": datetime.date.today().isoformat(),
        "quick": quick,
        "commit": measured_commit(),
        "machine": machine(),
        "versions": versions(),
        "data": data,
    }
    (RESULTS / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")


def _measured(record: dict[str, Any]) -> str:
    mode = "--quick" if record["quick"] else "full"
    commit = record.get("commit")
    at = f", agent at `{commit}`" if commit else ""
    return f"_Measured {record['date']} ({mode} run{at}) on {record['machine']}._"


def section_lines(name: str, record: dict[str, Any], docs: Path) -> list[str]:
    data = record["data"]
    if name == "speed":
        result = speed.from_json(data)
        plotted = speed.plot(result, docs / PLOT)
        lines = speed.section(result, PLOT if plotted else None)
    elif name == "hot-swap":
        lines = hot_swap.section(
            hot_swap.SwapResult(**data["swap"]), hot_swap.MemoryResult(**data["memory"])
        )
    elif name == "resend":
        lines = resend.section(resend.ResendFloodResult(**data))
    elif name == "drain":
        lines = delivery.section(delivery.DrainResult(**data))
    else:
        lines = local_sources.section(local_sources.from_json(data))
    return [lines[0], "", _measured(record), *lines[1:]]


def write_report(out: Path) -> None:
    results = load_results()
    if not results:
        return
    newest = max(results.values(), key=lambda r: str(r["date"]))
    lines = [
        "# Benchmarks",
        "",
        "Produced by `scripts/bench` (`benchmarks/run.py`; sections: "
        + ", ".join(f"`{s}`" for s in SECTIONS)
        + "). Every figure in a table comes from one run on one machine, side by side; "
        "absolute times on this shared machine are noisy, ratios much less so. Ratios that "
        "depend on the agent's threads handing work to each other (the message rates, "
        "batching, latency) still vary from day to day on this VM, by up to a half: to compare "
        "code, measure it side by side with `benchmarks/history.py` (its table is at the end), "
        "not against an older report.",
        "",
        f"- machine: {newest['machine']}, no GPU",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in newest["versions"].items()),
        "- setup: the agent as its own process (`edge-agent run`, 2 workers, defaults "
        "otherwise), a private Mosquitto with `set_tcp_nodelay true`, loopback",
        "",
    ]
    for name in SECTIONS:
        if name in results:
            lines += section_lines(name, results[name], out.parent)
    history = RESULTS / "history.json"
    if history.exists():
        from benchmarks import history as speed_history

        lines += speed_history.section(json.loads(history.read_text()))
    out.write_text("\n".join(lines))


def met(name: str, data: dict[str, Any]) -> bool:
    if name == "speed":
        figures = speed.from_json(data).figures()
        return all(speed.meets(k, v) is not False for k, v in figures.items())
    if name == "hot-swap":
        swap = hot_swap.SwapResult(**data["swap"])
        memory = hot_swap.MemoryResult(**data["memory"])
        return swap.ratio <= 2 and swap.failed == 0 and memory.growth_mb <= 10
    if name == "resend":
        return resend.ResendFloodResult(**data).ratio <= 2
    if name == "drain":
        return delivery.DrainResult(**data).ratio >= 0.5
    return local_sources.met(local_sources.from_json(data))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--quick", action="store_true", help="shorter measurements (alone: the speed section)"
    )
    parser.add_argument(
        "--only",
        default=None,
        help=f"comma-separated sections: {', '.join(SECTIONS)} (default: all; speed with --quick)",
    )
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks.md")
    parser.add_argument("--report-only", action="store_true", help="rewrite the report only")
    args = parser.parse_args(argv)
    only = args.only or ("speed" if args.quick else ",".join(SECTIONS))
    chosen = [s.strip() for s in only.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {unknown}; choose from {', '.join(SECTIONS)}")
    ok = True
    if not args.report_only:
        started = time.monotonic()
        for name in chosen:
            with (
                tempfile.TemporaryDirectory(prefix=f"edge-bench-{name}-") as tmp,
                EmbeddedBroker() as broker,
            ):
                data = RUNNERS[name](broker, Path(tmp), args.quick)
            save_result(name, data, args.quick)
            ok = met(name, data) and ok
        print(f"measured {', '.join(chosen)} in {time.monotonic() - started:.0f} s", flush=True)
    write_report(args.out)
    print(f"wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
