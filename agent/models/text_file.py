"""A small text file of a model's folder read with its size bounded first (`config.toml`, a
labels file, `config.json`): each caller words its own one-line errors.

A module of its own, importing nothing of the agent, so that `model_config` and the modules it
imports (`postprocess`) can all use it without an import cycle.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

__all__ = ["read_text_limited"]


def read_text_limited(
    path: Path,
    limit: int,
    *,
    too_large: Callable[[int], Exception],
    cannot_read: Callable[[OSError], Exception],
    not_text: Callable[[UnicodeDecodeError], Exception],
) -> str:
    """`path`'s UTF-8 text, its size checked before it is read. Raises `too_large(size)` over
    `limit` bytes, `cannot_read(error)` where it cannot be read, `not_text(error)` where it is
    not UTF-8 (the cause left off: the message says it)."""
    try:
        size = path.stat().st_size
        if size <= limit:
            return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise cannot_read(exc) from None
    except UnicodeDecodeError as exc:
        raise not_text(exc) from None
    raise too_large(size)
