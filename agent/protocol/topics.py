"""MQTT topics that come from outside: the one check every topic the agent would publish on
passes, whoever named it (a request's `reply_to`, an MQTT 5 Response Topic, a resend's
`reply_to`, the configuration).

A topic the broker refuses is worse than a refused request: Mosquitto drops the connection of
a client that publishes on a topic with a control character, and a QoS 1 reply on it would be
published again after every reconnect. So the check is stricter than MQTT's grammar, in
what MQTT and Mosquitto refuse or warn about: UTF-8 text of 1 to 256 characters, no wildcards,
no control characters (U+0000-U+001F, U+007F-U+009F), no Unicode noncharacters, and, for
names a path-like subscriber could misread, no empty, `.` or `..` levels.

Where replies may go (:class:`ReplyTopics`): under one of the allowed prefixes (by default
the device's own result tree, `{topic_prefix}/{device_id}/result/`), and never on the agent's
own other topics (`infer`, `resend`, `status`, ...), whatever the prefixes allow.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from agent.protocol.errors import MAX_REPLY_TO_CHARS, kind_of, show_value

__all__ = [
    "BAD_LEVELS",
    "MAX_TOPIC_CHARS",
    "ReplyTopics",
    "topic_prefix_problem",
    "topic_problem",
]

MAX_TOPIC_CHARS = MAX_REPLY_TO_CHARS  # 256: ample for a reply tree, small for a log line
MAX_MQTT_TOPIC_BYTES = 65535  # MQTT's own limit on a topic name
# Wildcards, C0 and C1 controls, and the noncharacters U+FDD0-U+FDEF and U+xFFFE/U+xFFFF
# (Mosquitto's UTF-8 check refuses those too; lone surrogates cannot be encoded at all).
_FORBIDDEN = re.compile(
    "[+#\x00-\x1f\x7f-\x9f\ufdd0-\ufdef\ufffe\uffff"
    + "".join(f"{chr(plane << 16 | 0xFFFE)}{chr(plane << 16 | 0xFFFF)}" for plane in range(1, 17))
    + "]"
)
BAD_LEVELS = ("", ".", "..")  # topic levels no reply topic (and no model name) has


def topic_problem(value: object, what: str = "topic") -> str | None:
    """Why `value` may not be a topic the agent publishes on; None when it may."""
    if not isinstance(value, str):
        return f"{what} must be text, got {kind_of(value)}"
    if not 1 <= len(value) <= MAX_TOPIC_CHARS:
        return f"{what} must be 1 to {MAX_TOPIC_CHARS} characters, got {len(value)}"
    return _characters_problem(value, what) or _levels_problem(value, what)


def topic_prefix_problem(value: str, what: str = "prefix") -> str | None:
    """Why `value` may not start a topic (configuration): as :func:`topic_problem`, with
    the one trailing `/` a prefix usually ends with."""
    return topic_problem(value[:-1] if value.endswith("/") else value, what)


def _characters_problem(value: str, what: str) -> str | None:
    found = _FORBIDDEN.search(value)
    if found is not None:
        char = found.group()
        kind = "an MQTT wildcard" if char in "+#" else "a control character or noncharacter"
        return (
            f"{what} {show_value(value)} has {kind} (U+{ord(char):04X} at {found.start()}); "
            "topics must not contain wildcards or control characters"
        )
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        return f"{what} {show_value(value)} is not valid UTF-8"
    if size > MAX_MQTT_TOPIC_BYTES:
        return f"{what} is {size} bytes (MQTT allows {MAX_MQTT_TOPIC_BYTES})"
    return None


def publish_problem(topic: str) -> str | None:
    """Why a broker would refuse a publish on `topic`, or drop the connection over it: the
    part of :func:`topic_problem` that MQTT and Mosquitto enforce (no length cap of ours,
    empty levels allowed). The last check before anything is published."""
    if not topic:
        return "the topic is empty"
    return _characters_problem(topic, "the topic")


def _levels_problem(value: str, what: str) -> str | None:
    for level in value.split("/"):
        if level in BAD_LEVELS:
            shown = "an empty level" if not level else f"a {level!r} level"
            return f"{what} {show_value(value)} has {shown}"
    return None


@dataclass(frozen=True)
class ReplyTopics:
    """Where a requester may have the agent publish: `prefixes` (allowed starts) and the
    agent's own `root` (`{topic_prefix}/{device_id}`), under which only `root/result/` is a
    reply topic. Compared by value: a request layout remembers the rule it was checked under."""

    prefixes: tuple[str, ...]
    root: str | None = None

    @classmethod
    def default_prefixes(cls, root: str) -> tuple[str, ...]:
        """The device's own result tree: nobody's topics but this device's replies."""
        return (f"{root}/result/",)

    def problem(self, value: object, what: str = "reply_to") -> str | None:
        """Why `value` may not be a reply topic; None when it may."""
        problem = topic_problem(value, what)
        if problem is not None:
            return problem
        assert isinstance(value, str)
        if self._is_own_control_topic(value):
            return (
                f"{what} {show_value(value)} is one of the agent's own topics; "
                f"replies under {self.root}/ go to {self.root}/result/"
            )
        if not any(value.startswith(p) for p in self.prefixes):
            allowed = ", ".join(repr(p) for p in self.prefixes) or "none configured"
            return f"{what} {show_value(value)} must start with an allowed prefix ({allowed})"
        return None

    def _is_own_control_topic(self, topic: str) -> bool:
        root = self.root
        if root is None or not (topic == root or topic.startswith(root + "/")):
            return False
        return not topic.startswith(root + "/result/")

    @classmethod
    def of(cls, prefixes: Sequence[str], root: str | None = None) -> ReplyTopics:
        return cls(tuple(prefixes), root)
