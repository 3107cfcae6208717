"""The configuration files shipped in configs/: each one loads, and `configs/agent.toml`, which
says it holds every key, names every key of the schema."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from agent.config import AgentConfig
from agent.config.loading import load_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    load_config(path, {})


def _section_of(annotation: object) -> type[BaseModel] | None:
    """The model a field holds: itself, in an Optional, or as a list's items."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        section = _section_of(field.annotation)
        keys += _keys(section, f"{prefix}{name}.") if section else [f"{prefix}{name}"]
    return keys


def test_the_reference_config_names_every_key_of_the_schema():
    text = (CONFIGS / "agent.toml").read_text()
    # a key set, commented out or not, or shown in a comment (`key = ...`), or a line of
    # the sources' key list (`#   key   what it is`)
    named = set(re.findall(r"(?:^|[\s,#(])([a-z_0-9]+) = ", text, re.M))
    named |= set(re.findall(r"^#   ([a-z_0-9]+) ", text, re.M))
    missing = [key for key in _keys(AgentConfig) if key.rsplit(".", 1)[-1] not in named]
    assert len(_keys(AgentConfig)) > 100
    assert missing == [], f"configs/agent.toml does not name: {missing}"
