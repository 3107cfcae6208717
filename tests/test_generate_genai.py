"""Folders of ONNX Runtime GenAI's model builder (Microsoft's published ONNX language models
are such folders): `genai_config.json` instead of Hugging Face's configs, the weights in
external data, an int4 decoder under its own file name. The agent serves them as they are and
streams the tokens of GenAI's own greedy generator, stopping at the eos ids the config names
(fixtures: `tests/fixtures/real/genai`, from `scripts/make_genai_models.py`)."""

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
from agent.inference import generate
from agent.inference.modes import Member, Run
from agent.models.backends.base import BackendOptions, ModelLoadError
from agent.models.backends.onnxruntime import OnnxRuntimeBackend
from agent.models.decoder_layout import context_in, open_generation
from agent.models.genai_config import read_genai_config
from agent.models.model_config import StreamConfig
from agent.models.tokenizer import open_tokenizer
from agent.service.agent import Agent
from tests.generate_helpers import GENERATE

GENAI = Path(__file__).resolve().parent / "fixtures" / "real" / "genai"
REFERENCE: dict[str, Any] = json.loads((GENAI / "reference.json").read_text(encoding="utf-8"))
PROMPTS = [c for c in REFERENCE["cases"] if "prompt" in c]
CHAT = next(c for c in REFERENCE["cases"] if "messages" in c)
NEW_TOKENS = int(REFERENCE["new_tokens"])
PARAMS = {"max_new_tokens": NEW_TOKENS}
INT4_FILE = "qwen2-cpu-int4-rtn-block-32-acc-level-4.onnx"


def finish_of(tokens: list[int]) -> str:
    return "eos" if tokens and tokens[-1] in REFERENCE["eos"] else "length"


def greedy(build: str, ids_list: list[list[int]]) -> list[list[int]]:
    """The agent's generate strategy over `build`'s folder, one run of all `ids_list`."""
    folder = GENAI / build
    model_file = folder / ("model.onnx" if build == "fp32" else INT4_FILE)
    session = OnnxRuntimeBackend().load(model_file, BackendOptions(1))
    try:
        setup = open_generation(None, session, folder)
        asks = [
            generate.ask_of({"input_ids": np.array(ids)}, {"max_new_tokens": NEW_TOKENS}, setup)
            for ids in ids_list
        ]
        run = Run(
            session, StreamConfig(mode="generate"), [Member({}, 1, generation=a) for a in asks]
        )
        tokens: dict[int, list[int]] = {k: [] for k in range(len(asks))}
        for pieces in generate.generate(run):
            for piece in pieces:
                tokens[piece.member] += [int(t) for t in piece.outputs["tokens"]]
        return [tokens[k] for k in range(len(asks))]
    finally:
        session.close()


@pytest.mark.parametrize("build", ["fp32", "int4"])
def test_the_builders_decoders_give_genais_own_tokens(build: str) -> None:
    """Each prompt's greedy tokens equal GenAI's generator's (for fp32 also Hugging Face's),
    stopping at either eos id of `genai_config.json`'s list."""
    for case in REFERENCE["cases"]:
        (tokens,) = greedy(build, [case["ids"]])
        assert tokens == case[build], case.get("prompt", "chat")
        if build == "fp32":
            assert tokens == case["hf"]
    assert {finish_of(c["fp32"]) for c in PROMPTS} == {"eos", "length"}


def test_what_genai_config_says_is_read_as_hugging_faces_files_say_it() -> None:
    folder = GENAI / "int4"
    genai = read_genai_config(folder)
    assert genai.hf_config["eos_token_id"] == REFERENCE["eos"]
    assert genai.generation_config["num_beams"] == 1
    assert context_in(folder) == 96  # model.context_length
    assert genai.names == {}  # the builder's names are the layout's own
    session = OnnxRuntimeBackend().load(folder / INT4_FILE, BackendOptions(1))
    try:
        layout = open_generation(None, session, folder).layout
    finally:
        session.close()
    assert layout.position_ids is None and not layout.batchable  # positions from the mask


@pytest.fixture(scope="module")
def genai_agent(
    broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Agent, AgentClient]]:
    from tests.conftest import agent_config, serve_agent

    tmp = tmp_path_factory.mktemp("genai")
    root = tmp / "models"
    for name, build in (("phi_like", "int4"), ("fp32", "fp32")):
        shutil.copytree(GENAI / build, root / name / "1")
        (root / name / "config.toml").write_text(GENERATE)
    for name, change in BROKEN.items():
        folder = root / name / "1"
        shutil.copytree(GENAI / "int4", folder)
        config = json.loads((folder / "genai_config.json").read_text(encoding="utf-8"))
        change(config)
        (folder / "genai_config.json").write_text(json.dumps(config), encoding="utf-8")
        (root / name / "config.toml").write_text(GENERATE)
    yield from serve_agent(broker, agent_config(tmp, broker, root), 20)


def _vision(config: dict[str, Any]) -> None:
    config["model"]["vision"] = {"filename": "vision.onnx"}


def _cache_names(config: dict[str, Any]) -> None:
    config["model"]["decoder"]["inputs"]["past_key_names"] = "past_key_%d"


def _outside(config: dict[str, Any]) -> None:
    config["model"]["decoder"]["filename"] = "../other.onnx"


def _missing(config: dict[str, Any]) -> None:
    config["model"]["decoder"]["filename"] = "absent.onnx"


def _beams(config: dict[str, Any]) -> None:
    config["search"]["num_beams"] = "three"


BROKEN = {
    "vision": _vision,
    "cache_names": _cache_names,
    "outside": _outside,
    "gone": _missing,
    "beams": _beams,
}


def test_a_published_folder_streams_text_as_it_is(
    genai_agent: tuple[Agent, AgentClient],
) -> None:
    """The int4 folder as the builder wrote it (no model.onnx: the decoder its config names,
    the weights in external data) streams GenAI's tokens for a prompt and for a conversation
    laid out by its chat template, with their text."""
    _, client = genai_agent
    codec = open_tokenizer(GENAI / "int4")
    assert codec is not None
    for case in PROMPTS:
        reply = client.request("phi_like", {"prompt": case["prompt"]}, params=PARAMS, timeout=30)
        chunks = list(reply)
        assert [int(t) for c in chunks for t in c.outputs["tokens"]] == case["int4"]
        assert reply.end.finish_reason == finish_of(case["int4"])
        assert "".join(c.text for c in chunks) == codec.decode(case["int4"])
    messages = np.array([[m["role"], m["content"]] for m in CHAT["messages"]])
    reply = client.request("phi_like", {"messages": messages}, params=PARAMS, timeout=30)
    assert [int(t) for c in reply for t in c.outputs["tokens"]] == CHAT["int4"]
    assert reply.end.usage["prompt_tokens"] == len(CHAT["ids"])


def test_the_configs_context_bounds_a_request(genai_agent: tuple[Agent, AgentClient]) -> None:
    _, client = genai_agent
    too_long = np.zeros(97, dtype=np.int64)  # model.context_length is 96
    with pytest.raises(AgentError, match=r"bad_request.*96"):
        client.request("fp32", {"input_ids": too_long}, stream=False, timeout=30).collect()


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("vision", "a pipeline of several models (vision before the decoder)"),
        ("cache_names", "the cache is named 'past_key_%d' (past_key_names)"),
        ("outside", "'../other.onnx' is not an .onnx file's name in the version folder"),
        ("gone", "neither model.onnx nor absent.onnx, the decoder genai_config.json names"),
        ("beams", "genai_config.json: num_beams = 'three' is not a count"),
    ],
)
def test_a_genai_config_the_agent_cannot_follow_fails_its_version(
    genai_agent: tuple[Agent, AgentClient], name: str, says: str
) -> None:
    agent, _ = genai_agent
    entry = agent.models.inventory()["models"][name]["versions"]["1"]
    assert entry["state"] == "failed"
    assert says in entry["error"]


def test_an_unreadable_genai_config_is_a_load_error(tmp_path: Path) -> None:
    (tmp_path / "genai_config.json").write_text('{"model": [1]}')
    with pytest.raises(ModelLoadError, match=r"genai_config\.json: model is not a table"):
        read_genai_config(tmp_path)
