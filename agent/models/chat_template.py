"""A generate version's chat template: a conversation made into its prompt, as `transformers`
makes it.

An instruction-tuned model is trained on conversations laid out by its own template (Jinja),
which `save_pretrained` writes beside the tokenizer: `chat_template.jinja` (transformers 4.43
and later), or the `chat_template` key of `tokenizer_config.json` (a text, or a list of named
templates of which `default` is taken). The template is rendered as
`tokenizer.apply_chat_template(messages, add_generation_prompt=True)` renders it: Jinja's
immutable sandbox with `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension and
a `generation` block (rendered as its body),
`raise_exception`, `strftime_now`, a `tojson` that does not escape HTML, and the tokenizer's
special tokens (`bos_token`, `eos_token`, ...) as variables. The text is then tokenized without
adding special tokens: the template places them.

Jinja2 comes with the `text` extra; without it a version with a template still loads (a
warning says so) and takes prompts, not conversations. Imports only `backends.base` and
`hf_files`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from agent.models.backends.base import ModelLoadError
from agent.models.hf_files import read_json, read_text, special_token

__all__ = ["ChatRefused", "ChatTemplate", "open_chat_template"]

TEMPLATE_FILE = "chat_template.jinja"
MAX_TEMPLATE_BYTES = 256 * 1024
# The special tokens transformers passes to a template (its SPECIAL_TOKENS_ATTRIBUTES).
_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
    "additional_special_tokens",
)

log = logging.getLogger(__name__)


class ChatRefused(ValueError):
    """A conversation the template cannot lay out (its own `raise_exception`, or an error
    rendering it): the message says why."""


class ChatTemplate:
    """A compiled template and the special tokens it is rendered with."""

    def __init__(self, template: Any, special_tokens: dict[str, Any]) -> None:
        self._template = template
        self._special_tokens = special_tokens

    def render(self, messages: Sequence[dict[str, str]]) -> str:
        """The prompt of `messages` ({role, content} each), ready for the assistant's turn."""
        import jinja2

        try:
            text = self._template.render(
                messages=list(messages), add_generation_prompt=True, **self._special_tokens
            )
        except jinja2.TemplateError as e:  # raise_exception's, a sandbox refusal, a bad name
            raise ChatRefused(f"the model's chat template refused the messages: {e}") from None
        except Exception as e:  # the template's own code failing on these messages
            raise ChatRefused(f"the model's chat template failed on the messages: {e}") from None
        return str(text)


def open_chat_template(folder: Path) -> ChatTemplate | None:
    """`folder`'s chat template, compiled; None where it has none, or where Jinja2 is not
    installed (a warning says so). ModelLoadError where it cannot be read or compiled."""
    tokenizer_config = read_json(folder / "tokenizer_config.json")
    source = _template_text(folder, tokenizer_config)
    if source is None:
        return None
    try:
        import jinja2  # noqa: F401
    except ImportError:
        log.warning(
            "%s has a chat template: install the 'text' extra (pip install "
            "'edge-stream-agent[text]') for requests to send messages; it takes prompts meanwhile",
            folder,
        )
        return None
    try:
        template = _compiled(source)
    except Exception as e:  # jinja2.TemplateSyntaxError, or an extension's own error
        raise ModelLoadError(f"the chat template does not compile: {e}") from e
    specials = {**read_json(folder / "special_tokens_map.json"), **tokenizer_config}
    return ChatTemplate(template, _special_tokens(specials))


def _template_text(folder: Path, tokenizer_config: dict[str, Any]) -> str | None:
    path = folder / TEMPLATE_FILE
    if path.is_file():
        return read_text(path, MAX_TEMPLATE_BYTES)
    found = tokenizer_config.get("chat_template")
    if isinstance(found, list):  # named templates: transformers takes "default"
        named = {t.get("name"): t.get("template") for t in found if isinstance(t, dict)}
        found = named.get("default")
    if found is None:
        return None
    if not isinstance(found, str):
        raise ModelLoadError("tokenizer_config.json's chat_template is not a text")
    return found


def _compiled(source: str) -> Any:
    """`source` compiled as transformers compiles a chat template."""
    from jinja2 import nodes
    from jinja2.exceptions import TemplateError
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}`: transformers marks the assistant's
        tokens with it (for training masks); rendering, it is its body."""

        tags = {"generation"}  # noqa: RUF012 (Jinja's own class attribute)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            call = self.call_method("_body")
            return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> Any:
            return caller()

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    def strftime_now(form: str) -> str:
        return datetime.now().strftime(form)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    return environment.from_string(source)


def _special_tokens(config: dict[str, Any]) -> dict[str, Any]:
    """The special tokens of `special_tokens_map.json` / `tokenizer_config.json` as texts
    (an AddedToken's fields give its content), as transformers' `special_tokens_map`."""
    found: dict[str, Any] = {}
    for key in _SPECIAL_TOKENS:
        value = config.get(key)
        if key == "additional_special_tokens" and isinstance(value, list):
            found[key] = [t for t in map(special_token, value) if t is not None]
        elif special_token(value) is not None:
            found[key] = special_token(value)
    return found
