"""The generate fixtures (tests/fixtures/real/decoders, made by scripts/make_decoders.py) as
model folders, and an agent serving them."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from agent.client import AgentClient
from agent.demo.broker import EmbeddedBroker
from agent.service.agent import Agent

DECODERS = Path(__file__).resolve().parent / "fixtures" / "real" / "decoders"
REFERENCE: dict[str, Any] = json.loads((DECODERS / "reference.json").read_text(encoding="utf-8"))
EOS = int(REFERENCE["eos"])
GENERATE = '[stream]\nmode = "generate"\n'


def write_decoder(root: Path, name: str, arch: str, extra: str = "", *, text: bool = True) -> None:
    """`root/name/1/` holding the `arch` fixture (without its tokenizer where `text` is off)."""
    folder = root / name / "1"
    shutil.copytree(DECODERS / arch, folder)
    if not text:
        (folder / "tokenizer.json").unlink()
    (root / name / "config.toml").write_text(GENERATE + extra)


def serve(
    broker: EmbeddedBroker, tmp: Path, models: dict[str, tuple[str, str]]
) -> Iterator[tuple[Agent, AgentClient]]:
    """An agent serving `models` (name -> (arch, extra config)), and a client."""
    from tests.conftest import agent_config, serve_agent

    root = tmp / "models"
    for name, (arch, extra) in models.items():
        write_decoder(root, name, arch, extra, text=not name.endswith("_ids"))
    yield from serve_agent(broker, agent_config(tmp, broker, root), 20)
