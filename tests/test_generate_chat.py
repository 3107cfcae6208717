"""Conversations in for a generate model with a chat template: `inputs.messages`, laid out as
Hugging Face's `apply_chat_template(add_generation_prompt=True)` lays them out, then greedy
tokens equal to `generate(do_sample=False)` (fixtures: `tests/fixtures/real/decoders/chat`
beside the Llama-like decoder, from `scripts/make_decoders.py --chat-only`)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.client import AgentClient, AgentError
from agent.demo.broker import EmbeddedBroker
from agent.service.agent import Agent
from tests.generate_helpers import DECODERS, GENERATE, REFERENCE

pytest.importorskip("jinja2")

CHAT = DECODERS / "chat"
CASES = REFERENCE["chat"]


def chat_folder(root: Path, name: str, *, form: str = "jinja") -> Path:
    """`root/name/1/`: the Llama-like decoder with the chat files: the template in
    `chat_template.jinja` (transformers 4.43 and later) or in `tokenizer_config.json`
    (`form = "config"`, as older versions saved it)."""
    folder = root / name / "1"
    shutil.copytree(DECODERS / "llama", folder)
    for file in ("tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(CHAT / file, folder / file)
    template = (CHAT / "chat_template.jinja").read_text(encoding="utf-8")
    if form == "jinja":
        (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
    else:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        config["chat_template"] = template
        (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    (root / name / "config.toml").write_text(GENERATE)
    return folder


@pytest.fixture(scope="module")
def chat_agent(
    broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Agent, AgentClient]]:
    from tests.conftest import agent_config, serve_agent

    tmp = tmp_path_factory.mktemp("chat")
    root = tmp / "models"
    chat_folder(root, "chat")
    chat_folder(root, "chat_in_config", form="config")
    broken = chat_folder(root, "chat_broken")
    (broken / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")
    shutil.copytree(DECODERS / "llama", root / "plain" / "1")
    (root / "plain" / "config.toml").write_text(GENERATE)
    yield from serve_agent(broker, agent_config(tmp, broker, root), 20)


def conversation(messages: list[dict[str, str]]) -> np.ndarray[Any, Any]:
    return np.array([[m["role"], m["content"]] for m in messages])


def chat(client: AgentClient, model: str, messages: np.ndarray[Any, Any]) -> Any:
    params = {"max_new_tokens": len(CASES[0]["greedy"])}
    reply = client.request(model, {"messages": messages}, params=params, timeout=30)
    return reply, list(reply)


@pytest.mark.parametrize("model", ["chat", "chat_in_config"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_a_conversation_gives_hugging_faces_tokens(
    chat_agent: tuple[Agent, AgentClient], model: str, case: int
) -> None:
    """The template's text (roles, contents trimmed, the eos token after each message, the
    assistant's cue) tokenized without added special tokens is `apply_chat_template`'s ids
    (usage.prompt_tokens), and the greedy tokens and their text are Hugging Face's."""
    _, client = chat_agent
    want = CASES[case]
    reply, chunks = chat(client, model, conversation(want["messages"]))
    assert [int(t) for c in chunks for t in c.outputs["tokens"]] == want["greedy"]
    assert "".join(c.text for c in chunks) == want["text"]
    assert reply.end.usage["prompt_tokens"] == len(want["ids"])


def test_a_prompt_still_goes_in_as_it_is(chat_agent: tuple[Agent, AgentClient]) -> None:
    _, client = chat_agent
    want = REFERENCE["models"]["llama"][0]
    params = {"max_new_tokens": len(want["greedy"])}
    got = client.request("chat", {"prompt": want["prompt"]}, params=params, stream=False)
    assert got.collect()["tokens"].tolist() == want["greedy"]


@pytest.mark.parametrize(
    ("model", "messages", "says"),
    [
        ("chat", np.array([["tool", "{}"]]), r"chat template refused the messages: Unknown role"),
        ("plain", np.array([["user", "hi"]]), r"needs a model with a chat template"),
        ("chat", np.array(["user", "hi"]), r"string tensor \[n, 2\]"),
        ("chat", np.array([["user", "hi", "x"]]), r"string tensor \[n, 2\]"),
        ("chat", np.zeros((1, 2), np.float32), r"string tensor \[n, 2\]"),
        ("chat", np.array([["user", 3]], dtype=object), r"is int, not text"),
    ],
)
def test_a_conversation_the_model_cannot_take(
    chat_agent: tuple[Agent, AgentClient], model: str, messages: Any, says: str
) -> None:
    _, client = chat_agent
    with pytest.raises(AgentError, match=r"bad_request.*" + says):
        client.request(model, {"messages": messages}, stream=False, timeout=30).collect()


def test_a_template_that_does_not_compile_fails_its_version(
    chat_agent: tuple[Agent, AgentClient],
) -> None:
    agent, _ = chat_agent
    entry = agent.models.inventory()["models"]["chat_broken"]["versions"]["1"]
    assert entry["state"] == "failed"
    assert "the chat template does not compile" in entry["error"]


def test_the_inventory_says_a_conversation_goes_in(
    chat_agent: tuple[Agent, AgentClient],
) -> None:
    agent, _ = chat_agent
    models = agent.models.inventory()["models"]
    assert models["chat"]["versions"]["1"]["text_inputs"] == ["prompt", "messages"]
    assert models["plain"]["versions"]["1"]["text_inputs"] == ["prompt"]


def test_a_text_that_cannot_fit_is_refused_before_it_is_cut(
    chat_agent: tuple[Agent, AgentClient],
) -> None:
    """The decoder's context (config.json: 128) at 100 characters a token at most."""
    _, client = chat_agent
    with pytest.raises(AgentError, match=r"bad_request: inputs.prompt is 12801 characters"):
        client.request("chat", {"prompt": "a" * 12801}, stream=False, timeout=30).collect()
    long = np.array([["user", "a" * 12801]])
    with pytest.raises(AgentError, match=r"bad_request: the conversation laid out is \d+ char"):
        client.request("chat", {"messages": long}, stream=False, timeout=30).collect()
