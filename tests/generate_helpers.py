"""The generate fixtures (tests/fixtures/real/decoders, made by scripts/make_decoders.py) as
model folders, and an agent serving them."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.client import AgentClient
from agent.demo.broker import EmbeddedBroker
from agent.models.backends.onnxruntime import OnnxSession
from agent.service.agent import Agent

DECODERS = Path(__file__).resolve().parent / "fixtures" / "real" / "decoders"
REFERENCE: dict[str, Any] = json.loads((DECODERS / "reference.json").read_text(encoding="utf-8"))
EOS = int(REFERENCE["eos"])
GENERATE = '[stream]\nmode = "generate"\n'


def streamed(client: AgentClient, model: str, inputs: dict[str, Any], **params: Any) -> Any:
    """A generate request's reply and its chunks, read to the end (30 s at most)."""
    reply = client.request(model, inputs, params=params or None, timeout=30)
    return reply, list(reply)


def tokens_of(chunks: list[Any]) -> list[int]:
    """The tokens of a stream's chunks, in order."""
    return [int(t) for c in chunks for t in c.outputs["tokens"]]


def tokens_by_member(session: Any, asks: list[Any]) -> tuple[Any, dict[int, list[int]]]:
    """`asks` (`GenerateAsk`s) as the members of one run on `session`, generated to their
    ends: the run (its counts) and each member's tokens."""
    from agent.inference import generate
    from agent.inference.modes import Member, Run
    from agent.models.model_config import StreamConfig

    run = Run(session, StreamConfig(mode="generate"), [Member({}, 1, generation=a) for a in asks])
    tokens: dict[int, list[int]] = {k: [] for k in range(len(asks))}
    for pieces in generate.generate(run):
        for piece in pieces:
            tokens[piece.member] += [int(t) for t in piece.outputs["tokens"]]
    return run, tokens


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


def spy_on_bound_caches(monkeypatch: pytest.MonkeyPatch) -> list[set[type]]:
    """From now on, each bound run (`OnnxSession.run_keeping`) notes the types of the cache
    inputs it was fed (`numpy.ndarray`: a host copy; `onnxruntime.OrtValue`: kept bound)."""
    fed: list[set[type]] = []
    run_keeping = OnnxSession.run_keeping

    def spy(self: OnnxSession, inputs: dict[str, object], keep: object) -> object:
        fed.append({type(v) for k, v in inputs.items() if k.startswith("past_key_values.")})
        return run_keeping(self, inputs, keep)  # type: ignore[arg-type]

    monkeypatch.setattr(OnnxSession, "run_keeping", spy)
    return fed
