#!/usr/bin/env python3
"""Benchmarks of the agent, measured side by side; results go to docs/benchmarks.md.

    python benchmarks/run.py                        # every section, full length (~5 min)
    python benchmarks/run.py --quick                # the speed targets, short: under a minute
    python benchmarks/run.py --quick --only hot-swap,drain   # other sections, short
    python benchmarks/run.py --report-only          # rewrite the reports from saved results
    scripts/bench [ARGS]                            # any of these, installing what it needs first

Each section is measured in one run on one machine and saved to
`benchmarks/results/SECTION.json`; the report is written from every saved section, so running
one section keeps the others' last figures (each section says when it was measured). The
agent runs as its own process (`edge-agent run`), as on a box; the broker is a private
Mosquitto with `set_tcp_nodelay true`. `benchmarks/history.py` measures the speed section
against earlier commits; its table (`benchmarks/results/history.json`) is written to
docs/benchmarks-history.md, beside the report, which links to it.

Both files are Markdown for reading: prose is wrapped at `WIDTH` characters (`wrap_markdown`);
tables, headings and code stay one line each.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agent.client import AgentClient  # noqa: E402
from agent.demo.broker import EmbeddedBroker  # noqa: E402
from benchmarks import (  # noqa: E402
    by_host,
    delivery,
    generate,
    hot_swap,
    one_stream,
    resend,
    reuse,
    scan,
    speed,
)
from benchmarks import images as image_bench  # noqa: E402
from benchmarks import sources as local_sources  # noqa: E402
from benchmarks.harness import AgentProcess, machine, versions, wait_online  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
BY_HOST = RESULTS / "by-host.json"  # the latest full run of each section on each host
PLOT = "benchmarks-speed.png"
HISTORY_DOC = "benchmarks-history.md"  # written beside the report
WIDTH = 100  # prose lines of the reports
Runner = Callable[[EmbeddedBroker, Path, bool], dict[str, Any]]  # a section measured: its data


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


# Every section, in the report's order: a module with the sections' shared interface
# (`measure`, `to_json`, `from_json`, `section`, `met`), measured, reported and judged by one
# path; or, where its module has no such interface, run.py's own runner (the section's lines
# and target are in `_own_section_lines` and `_own_met`).
SECTIONS: dict[str, ModuleType | Runner] = {
    "speed": run_speed,
    "one-stream": one_stream,
    "hot-swap": run_hot_swap,
    "resend": run_resend,
    "drain": run_drain,
    "sources": local_sources,
    "scan": scan,
    "generate": generate,
    "images": image_bench,
    "reuse": reuse,
}
REPORT_ONLY = {"reuse"}  # sections with no target: not in the table of targets


def measure(name: str, broker: EmbeddedBroker, workdir: Path, quick: bool) -> dict[str, Any]:
    """Section `name` measured: the data saved in its result."""
    entry = SECTIONS[name]
    if isinstance(entry, ModuleType):
        return dict(entry.to_json(entry.measure(broker, workdir, quick)))
    return entry(broker, workdir, quick)


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

# A word that must not begin a wrapped line: there it would start a list item, a quote, a
# heading or a setext underline instead of continuing the paragraph.
_BLOCK_START = re.compile(r"^([-+*>]|#+|\d+[.)]|=+|-+)$")
_KEEP = ("|", "#", "```", "![", "<")  # tables, headings, fences, images, HTML: one line each


def wrap_markdown(text: str, width: int = WIDTH) -> str:
    """`text` with every paragraph and list item wrapped at `width` characters.

    The sections build each paragraph as one line (easy to write, unreadable in a diff or an
    editor). Tables, headings, fenced code and images stay as they are; a list item's lines
    continue under its text. Words are never broken, so a backquoted span or a link too long
    for a line keeps its own line."""
    out: list[str] = []
    fenced = False
    for line in text.split("\n"):
        if line.startswith("```"):
            fenced = not fenced
        kept = line.startswith(_KEEP) or line.startswith(("    ", "\t"))  # or indented code
        if fenced or line.startswith("```") or not line.strip() or kept:
            out.append(line)
            continue
        leading = line[: len(line) - len(line.lstrip())]
        marker = re.match(r"^(\s*(?:[-*+]|\d+[.)])\s+)", line)
        indent = " " * len(marker.group(1)) if marker else leading
        wrapped = _wrap_words(line.split(), width - len(leading), indent[len(leading) :])
        out += [leading + w for w in wrapped]
    return "\n".join(out)


def _wrap_words(words: list[str], width: int, indent: str) -> list[str]:
    """Greedy filling; a line that would begin with a block-starting word takes the previous
    line's last words along, as many as it takes to begin with another word."""
    lines: list[list[str]] = [[]]
    for word in words:
        current = lines[-1]
        prefix = indent if len(lines) > 1 else ""
        if current and len(prefix) + len(" ".join(current)) + 1 + len(word) > width:
            carried: list[str] = []
            while len(current) > 1 and _BLOCK_START.match((carried or [word])[0]):
                carried.insert(0, current.pop())
            lines.append(carried)
        lines[-1].append(word)
    return [(indent if i else "") + " ".join(ws) for i, ws in enumerate(lines)]


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
    by_host.remember(BY_HOST, name, record)


def _measured(record: dict[str, Any]) -> str:
    mode = "--quick" if record["quick"] else "full"
    commit = record.get("commit")
    at = f", agent at `{commit}`" if commit else ""
    return f"_Measured {record['date']} ({mode} run{at}) on {record['machine']}._"


def section_lines(name: str, record: dict[str, Any], docs: Path, plot: bool = True) -> list[str]:
    """One section of the report. With `plot`, the speed section's figure is drawn again
    (when matplotlib is there); without, the figure already in `docs` is linked as it is."""
    entry = SECTIONS[name]
    if isinstance(entry, ModuleType):
        lines = list(entry.section(entry.from_json(record["data"])))
    else:
        lines = _own_section_lines(name, record["data"], docs, plot)
    return [lines[0], "", _measured(record), *lines[1:]]


def _own_section_lines(name: str, data: dict[str, Any], docs: Path, plot: bool) -> list[str]:
    """The lines of a section measured by run.py's own runner."""
    if name == "speed":
        result = speed.from_json(data)
        plotted = (plot and speed.plot(result, docs / PLOT)) or (docs / PLOT).exists()
        return speed.section(result, PLOT if plotted else None)
    if name == "hot-swap":
        return hot_swap.section(
            hot_swap.SwapResult(**data["swap"]), hot_swap.MemoryResult(**data["memory"])
        )
    if name == "resend":
        return resend.section(resend.ResendFloodResult(**data))
    return delivery.section(delivery.DrainResult(**data))


def report_lines(results: dict[str, dict[str, Any]], docs: Path, plot: bool) -> list[str]:
    """docs/benchmarks.md: the latest saved run of each section, nothing older."""
    newest = max(results.values(), key=lambda r: str(r["date"]))
    lines = [
        "# Benchmarks",
        "",
        "The latest run of each section of `scripts/bench` (`benchmarks/run.py`; sections: "
        + ", ".join(f"`{s}`" for s in SECTIONS)
        + "). Every figure in a table comes from one run on one machine, side by side with its "
        "baseline; each section says when and at which commit it was measured. Absolute times "
        "on this shared machine are noisy, ratios much less so, though the ratios that depend "
        "on the agent's threads handing work to each other (the message rates, batching, "
        "latency) still move from day to day by up to a half. To compare code, measure it side "
        "by side with `benchmarks/history.py`, not against an older report: its table of "
        f"earlier commits is [{HISTORY_DOC}]({HISTORY_DOC}), and how the figures are taken is "
        "in [decisions/0018](decisions/0018-benchmarks-side-by-side.md).",
        "",
        f"- machine: {newest['machine']}, no GPU",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in newest["versions"].items()),
        "- setup: the agent as its own process (`edge-agent run`, 2 workers, defaults "
        "otherwise), a private Mosquitto with `set_tcp_nodelay true`, loopback",
        "",
    ]
    targeted = [name for name in SECTIONS if name not in REPORT_ONLY]
    lines += by_host.lines(by_host.load(BY_HOST), targeted, _record_met, headline)
    for name in SECTIONS:
        if name in results:
            lines += section_lines(name, results[name], docs, plot)
    return lines


def headline(name: str, record: dict[str, Any]) -> str:
    """Section `name`'s target figures of a saved run in one cell; "" where it has none."""
    entry = SECTIONS[name]
    if name == "speed":  # many targets: the ones missed
        figures = speed.from_json(record["data"]).figures()
        missed = [f"{k} {v:.2f}" for k, v in figures.items() if speed.meets(k, v) is False]
        return "below target: " + ", ".join(missed) if missed else ""
    if not isinstance(entry, ModuleType) or not hasattr(entry, "headline"):
        return ""
    return str(entry.headline(entry.from_json(record["data"])))


def _record_met(name: str, record: dict[str, Any]) -> bool:
    return met(name, record["data"])


def write_report(out: Path, plot: bool = True) -> list[Path]:
    """Write the report to `out` and, when a history was measured, its table beside it
    (`HISTORY_DOC`); both wrapped for reading. Returns the files written."""
    from benchmarks import history as speed_history

    written = []
    results = load_results()
    if results:
        out.write_text(wrap_markdown("\n".join(report_lines(results, out.parent, plot))))
        written.append(out)
    history = RESULTS / "history.json"
    if history.exists():
        target = out.parent / HISTORY_DOC
        lines = speed_history.document(json.loads(history.read_text()), out.name)
        target.write_text(wrap_markdown("\n".join(lines)))
        written.append(target)
    return written


def met(name: str, data: dict[str, Any]) -> bool:
    """Whether section `name`'s saved `data` meets its target."""
    entry = SECTIONS[name]
    if isinstance(entry, ModuleType):
        return bool(entry.met(entry.from_json(data)))
    return _own_met(name, data)


def _own_met(name: str, data: dict[str, Any]) -> bool:
    """Whether a section measured by run.py's own runner meets its target."""
    if name == "speed":
        figures = speed.from_json(data).figures()
        return all(speed.meets(k, v) is not False for k, v in figures.items())
    if name == "hot-swap":
        swap = hot_swap.SwapResult(**data["swap"])
        memory = hot_swap.MemoryResult(**data["memory"])
        return swap.ratio <= 2 and swap.failed == 0 and memory.growth_mb <= 10
    if name == "resend":
        return resend.ResendFloodResult(**data).ratio <= 2
    return delivery.DrainResult(**data).ratio >= 0.5


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
    parser.add_argument(
        "--report-only",
        "--render-only",
        action="store_true",
        help="measure nothing: rewrite the report and the history from benchmarks/results "
        "(the speed figure already in docs/ is kept, not drawn again)",
    )
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
                data = measure(name, broker, Path(tmp), args.quick)
            save_result(name, data, args.quick)
            ok = met(name, data) and ok
        print(f"measured {', '.join(chosen)} in {time.monotonic() - started:.0f} s", flush=True)
    for path in write_report(args.out, plot=not args.report_only):
        print(f"wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
