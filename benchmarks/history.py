#!/usr/bin/env python3
"""What each optimisation gained: the speed suite against earlier commits, side by side.

    python benchmarks/history.py REV [REV ...]          # --quick runs of each, in one go
    python benchmarks/history.py --full REV [REV ...]

Each revision is checked out into a temporary git worktree and its agent (only the agent: the
harness, the models and the baselines stay this checkout's) is measured with the speed suite,
one revision after the other on the same broker and machine. The results go to
`benchmarks/results/history.json` and into docs/benchmarks.md ("What each optimisation
gained"). A figure a revision cannot produce (dynamic batching before it existed) is n/a.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agent.demo.broker import EmbeddedBroker  # noqa: E402
from benchmarks import speed  # noqa: E402
from benchmarks.harness import machine  # noqa: E402

HISTORY = REPO / "benchmarks" / "results" / "history.json"
COLUMNS = (
    ("ttfc", "first/whole"),
    ("qos1", "QoS 1 / raw"),
    ("qos0", "QoS 0 / raw"),
    ("qos2", "QoS 2 / raw"),
    ("naive", "/ naive"),
    ("latency", "latency ratio"),
    ("batching", "batching on/off"),
    ("memory_growth", "memory growth"),
    ("idle_rss", "idle RSS"),
    ("ready_s", "start to ready"),
)


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()


def measure_revision(rev: str, quick: bool, broker: EmbeddedBroker) -> dict[str, Any]:
    sha = _git("rev-parse", "--short", rev)
    subject = _git("log", "-1", "--format=%s", rev)
    with tempfile.TemporaryDirectory(prefix="edge-history-") as tmp:
        tree = Path(tmp) / "tree"
        _git("worktree", "add", "--detach", str(tree), rev)
        try:
            print(f"== {sha} {subject}", flush=True)
            result = speed.measure(broker, Path(tmp) / "work", quick, tree=tree)
        finally:
            _git("worktree", "remove", "--force", str(tree))
    return {
        "rev": sha,
        "subject": subject,
        "figures": result.figures(),
        "data": speed.to_json(result),
    }


def section(history: dict[str, Any]) -> list[str]:
    mode = "--quick" if history["quick"] else "full"
    lines = [
        "## What each optimisation gained",
        "",
        f"_Measured {history['date']} ({mode} runs, one after the other) on "
        f"{history['machine']} by `python benchmarks/history.py`._",
        "",
        "The speed suite against the agent of each commit below (this checkout's harness, "
        "models and baselines; only the agent differs), oldest first. Every row is a "
        "separate agent run, so compare rows for the direction and size of a change, and the "
        "section above for the current figures. Before dynamic batching existed, the agent "
        "ran the 16 streams unbatched and had no batching figure (n/a). Every row is driven by "
        "this checkout's batching driver (a minimal MQTT client since `4476029`, paho before: "
        "old rows read higher than in earlier reports) and `[batching]` settings "
        "(`max_batch = 32` since `8f3ef7a`, 64 before: rows from older reports read lower), "
        "and a quick run's batching ratio moves "
        "by a few tenths between runs of nearly the same agent. The last two columns "
        "are absolute: requests a second to the 256-1024-1024-10 MLP without batching, and "
        "one stream alone.",
        "",
        "| commit | "
        + " | ".join(label for _, label in COLUMNS)
        + " | req/s, 64 concurrent, no batching | chunks/s, one stream, QoS 1 |",
        "|---|" + "---|" * (len(COLUMNS) + 2),
    ]
    for row in history["rows"]:
        cells = [speed.fmt(key, row["figures"].get(key)) for key, _ in COLUMNS]
        data = row["data"]
        off = data.get("batching", {}).get("off")
        single = data.get("rates", {}).get("1", {}).get("single")
        cells += [
            "n/a" if off is None else f"{off:.0f}",
            "n/a" if single is None else f"{single:.0f}",
        ]
        subject = row["subject"] if len(row["subject"]) <= 90 else row["subject"][:88] + "…"
        lines.append(f"| `{row['rev']}` {subject} | " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("revs", nargs="+", help="commits, oldest first")
    parser.add_argument("--full", action="store_true", help="full-length runs (slower)")
    args = parser.parse_args(argv)
    rows = []
    with EmbeddedBroker() as broker:
        for rev in args.revs:
            rows.append(measure_revision(rev, not args.full, broker))
    HISTORY.parent.mkdir(parents=True, exist_ok=True)
    history = {
        "date": datetime.date.today().isoformat(),
        "quick": not args.full,
        "machine": machine(),
        "rows": rows,
    }
    HISTORY.write_text(json.dumps(history, indent=1) + "\n")
    from benchmarks import run

    run.write_report(run.REPO / "docs" / "benchmarks.md")
    print("\n".join(section(history)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
