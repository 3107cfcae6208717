"""A chat template rendered as transformers renders one (`agent.models.chat_template`),
without a model or a broker."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agent.models.backends.base import ModelLoadError
from agent.models.chat_template import ChatRefused, open_chat_template
from tests.models_helpers import hide_module

pytest.importorskip("jinja2")

USER = [{"role": "user", "content": "<b>hi</b>"}]


def folder_with(tmp_path: Path, template: Any, **config: Any) -> Path:
    """`tmp_path` with `template` in `tokenizer_config.json`, and `config` beside it."""
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": template, **config})
    )
    return tmp_path


def render(folder: Path, messages: list[dict[str, str]] = USER) -> str:
    chat = open_chat_template(folder)
    assert chat is not None
    return chat.render(messages)


def test_special_tokens_and_the_generation_prompt(tmp_path: Path) -> None:
    """The special tokens of tokenizer_config.json (an AddedToken's content too) and of
    special_tokens_map.json are the template's variables; the assistant's cue is asked."""
    template = (
        "{{ bos_token }}{% for m in messages %}{{ m.role }}={{ m.content }}{{ eos_token }}"
        "{% endfor %}{% if add_generation_prompt %}{{ additional_special_tokens[0] }}{% endif %}"
    )
    folder = folder_with(tmp_path, template, eos_token={"content": "</s>", "special": True})
    specials = {"bos_token": "<s>", "additional_special_tokens": [{"content": "<cue>"}]}
    (folder / "special_tokens_map.json").write_text(json.dumps(specials))
    assert render(folder) == "<s>user=<b>hi</b></s><cue>"


def test_transformers_filters_and_blocks(tmp_path: Path) -> None:
    """`tojson` leaves HTML alone, `{% generation %}` renders its body, loop controls work,
    blocks trim their newline as transformers' environment does."""
    template = (
        "{% for m in messages %}\n{% if m.role == 'skip' %}{% continue %}{% endif %}"
        "{% generation %}{{ m | tojson }}{% endgeneration %}\n{% endfor %}"
    )
    messages = [*USER, {"role": "skip", "content": "x"}]
    # transformers' render_jinja_template gives the same, the newlines trimmed
    assert render(folder_with(tmp_path, template), messages) == (
        '{"role": "user", "content": "<b>hi</b>"}'
    )


def test_named_templates_take_the_default(tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]
    assert render(folder_with(tmp_path, named)) == "plain"


def test_the_jinja_file_wins_over_the_config(tmp_path: Path) -> None:
    folder = folder_with(tmp_path, "from the config")
    (folder / "chat_template.jinja").write_text("from the file")
    assert render(folder) == "from the file"


def test_no_template_no_chat(tmp_path: Path) -> None:
    assert open_chat_template(tmp_path) is None
    assert open_chat_template(folder_with(tmp_path, None)) is None


@pytest.mark.parametrize(
    ("template", "says"),
    [
        ("{{ raise_exception('only users') }}", "refused the messages: only users"),
        ("{{ messages.__class__.__mro__ }}", "refused the messages"),  # the sandbox
        ("{{ messages[5].content }}", "refused the messages"),  # undefined
        ("{{ 1 / 0 }}", "failed on the messages: division by zero"),
    ],
)
def test_a_render_that_fails_says_why(tmp_path: Path, template: str, says: str) -> None:
    with pytest.raises(ChatRefused, match=says):
        render(folder_with(tmp_path, template))


@pytest.mark.parametrize(
    ("template", "says"),
    [("{% for %}", "does not compile"), (5, "is not a text")],
)
def test_a_template_that_cannot_load(tmp_path: Path, template: Any, says: str) -> None:
    with pytest.raises(ModelLoadError, match=says):
        open_chat_template(folder_with(tmp_path, template))


def test_without_jinja_the_model_takes_prompts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    folder = folder_with(tmp_path, "plain")
    hide_module(monkeypatch, "jinja2")
    assert open_chat_template(folder) is None
    assert "install the 'text' extra" in caplog.text
