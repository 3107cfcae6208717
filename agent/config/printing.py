"""Printing the configuration (`check-config`): as plain data with every secret masked, and
as TOML. `SECRET_MASK` is also what the logs write in place of a secret (agent.ops.logs). A
source's URL may carry secrets too (`rtsp://user:password@camera/stream?token=...`):
`safe_url` masks its password and query values, `url_secrets` lists them for the logs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from agent.config.schema import AgentConfig

SECRET_MASK = "***"
SECRET_KEYS = frozenset({"password", "password_file", "key_file", "token"})


def masked_dict(config: AgentConfig) -> dict[str, Any]:
    """The effective configuration as plain data, with every secret replaced by a mask."""

    def mask(node: Any) -> Any:
        if isinstance(node, dict):
            return {
                k: (
                    SECRET_MASK
                    if k in SECRET_KEYS and v is not None
                    else safe_url(v)
                    if k == "url" and isinstance(v, str)
                    else mask(v)
                )
                for k, v in node.items()
            }
        if isinstance(node, list):
            return [mask(v) for v in node]
        return node

    result: dict[str, Any] = mask(config.model_dump(mode="json"))
    # keys whose empty value means a default made from others: shown as they take effect
    result["mqtt"]["client_id"] = config.client_id
    result["mqtt"]["allowed_reply_prefixes"] = list(config.reply_topics.prefixes)
    return result


def to_toml(data: Mapping[str, Any], _prefix: str = "") -> str:
    """Render plain config data as TOML (scalars first, then sections) for check-config."""
    lines: list[str] = []
    tables = []
    array_tables = []
    for key, value in data.items():
        if isinstance(value, dict):
            tables.append((key, value))
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            array_tables.append((key, value))  # [[sources]]
        elif value is not None:
            lines.append(f"{key} = {_toml_value(value)}")
    out = "\n".join(lines)
    for key, value in tables:
        name = f"{_prefix}{key}"
        body = to_toml(value, f"{name}.")
        out += (
            f"\n\n[{name}]\n{body}" if body and not body.startswith("\n") else f"\n\n[{name}]{body}"
        )
    for key, items in array_tables:
        name = f"{_prefix}{key}"
        for item in items:
            body = to_toml(item, f"{name}.")
            out += f"\n\n[[{name}]]" + (f"\n{body}" if body and not body.startswith("\n") else body)
    return out.strip("\n") if not _prefix else out


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    text = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'


def safe_url(url: str) -> str:
    """`url` with its password and its query's values masked (the user and host kept)."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return url
    netloc = parts.netloc
    if password is not None:
        user = parts.username or ""
        netloc = f"{user}:{SECRET_MASK}@{netloc.rpartition('@')[2]}"
    query = "&".join(f"{key}={SECRET_MASK}" for key, _ in parse_qsl(parts.query, True))
    return urlunsplit((parts.scheme, netloc, parts.path, query or parts.query, parts.fragment))


def url_secrets(url: str) -> list[str]:
    """The password and the token-like query values of `url`, for the logs to mask wherever
    they appear (a reader's own error may quote the URL). Short values are left: masking
    every "1" would blind the logs, and `safe_url` masks them where the URL is shown."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return []
    tokens = [value for _, value in parse_qsl(parts.query) if len(value) >= 8]
    return [*([password] if password and len(password) >= 3 else []), *tokens]
