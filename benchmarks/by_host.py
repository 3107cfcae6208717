"""The latest full run of every section on every kind of host the benchmarks ran on.

This shared machine is lent on more than one kind of host (its CPU model changes from one session
to the next), and some ratios differ between them by more than any change to the agent has
moved them: the one-stream ratio at QoS 0, for one, has read about 1.0 on one host and about 0.5
on another at the same commit. The report's sections show the latest run of each; this keeps,
beside it, the latest full run on each host (`benchmarks/results/by-host.json`), so the report
can say which targets are met where instead of whichever host ran last.

A `--quick` run is never kept here: its shorter measurements are not comparable with a full one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

Record = dict[str, Any]  # what benchmarks/run.py saves: date, quick, commit, machine, data, ...
ByHost = dict[str, dict[str, Record]]  # section -> host -> its latest full run there


def host(record: Record) -> str:
    """The host a record was measured on: its CPU model (`harness.machine()` begins with it)."""
    return str(record.get("machine", "?")).split(", ")[0]


def load(path: Path) -> ByHost:
    if not path.exists():
        return {}
    data: ByHost = json.loads(path.read_text())
    return data


def remember(path: Path, section: str, record: Record) -> None:
    """Keep `record` as `section`'s latest run on its host (a full run only), the other hosts'
    runs as they are."""
    if record.get("quick"):
        return
    runs = load(path)
    runs.setdefault(section, {})[host(record)] = record
    path.write_text(json.dumps(runs, indent=1, sort_keys=True) + "\n")


def lines(
    runs: ByHost,
    order: list[str],
    met: Callable[[str, Record], bool],
    headline: Callable[[str, Record], str],
) -> list[str]:
    """The report's table of verdicts: a row per section and host, sections in `order`."""
    if not runs:
        return []
    out = [
        "## Targets on each host",
        "",
        "The machine these benchmarks run on is lent on more than one kind of host, and some "
        "ratios (those that depend on the agent's threads handing work to each other) differ "
        "between hosts by more than any change to the agent moved them. Each row is the latest "
        "full run of a section on one host (`benchmarks/results/by-host.json`); the sections "
        "below show the latest run of each, on whichever host made it. A `lean loop` figure in "
        "brackets is a reference, not a target: the same loop publishing its own messages with "
        "no agent, the least a Python publisher reaches on that host "
        "([decisions/0040](decisions/0040-lean-loops-beside-the-targets.md)).",
        "",
        "| section | host | measured | figures | targets |",
        "|---|---|---|---|---|",
    ]
    for section in order:
        for name, record in sorted(runs.get(section, {}).items()):
            commit = record.get("commit")
            when = f"{record['date']}, `{commit}`" if commit else str(record["date"])
            verdict = "met" if met(section, record) else "**missed**"
            figures = headline(section, record) or "see the section"
            out.append(f"| `{section}` | {name} | {when} | {figures} | {verdict} |")
    return [*out, ""]
