"""The house rules of `agent/`, checked on the source: module size, the packages' import rules
(as their `__init__` docstrings state them), no import cycles, paho's private names in one
module only."""

from __future__ import annotations

import ast
import re
from pathlib import Path

AGENT = Path(__file__).resolve().parent.parent / "agent"
MAX_LINES = 500

# What each part of the agent may import of the agent (besides itself). `agent` alone is the
# package's `__init__` (its version).
MAY_IMPORT: dict[str, set[str]] = {
    "agent.config": {"agent.protocol", "agent.ops.systemd"},  # systemd credentials
    "agent.protocol": {"agent.models.backends.base"},
    "agent.delivery": {"agent.protocol", "agent.config"},
    "agent.mqtt": {"agent.config", "agent.delivery", "agent.protocol"},
    "agent.models": {"agent.protocol", "agent.config"},
    "agent.ops": {"agent.config", "agent.protocol"},
    "agent.inference": {
        "agent.protocol",
        "agent.delivery",
        "agent.models",
        "agent.ops",
        "agent.config",
    },
    "agent.sources": {
        "agent.protocol",
        "agent.delivery",
        "agent.inference",
        "agent.models",
        "agent.ops",
        "agent.config",
    },
    "agent.client": {"agent.protocol", "agent.config", "agent.models.backends.base"},
}
PAHO_WALL = "agent.mqtt.paho_fast"


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(AGENT.rglob("*.py")):
        parts = path.relative_to(AGENT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _top_level_imports(path: Path, name: str) -> set[str]:
    """Modules of the agent imported at module level (not under TYPE_CHECKING, not inside
    functions: those are deliberate late imports)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    imported: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, ast.Import):
            imported.update(a.name for a in node.names if a.name.startswith("agent"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            if not base.startswith("agent"):
                continue
            for alias in node.names:  # `from agent.x import y` may name a module y
                candidate = f"{base}.{alias.name}"
                imported.add(candidate if candidate in _modules() else base)
    return imported


def _part(module: str) -> str:
    """The rule that governs a module: the longest key of MAY_IMPORT it falls under."""
    keys = [k for k in MAY_IMPORT if module == k or module.startswith(k + ".")]
    return max(keys, key=len) if keys else ""


def test_no_module_is_over_the_size_limit() -> None:
    sizes = {n: len(p.read_text().splitlines()) for n, p in _modules().items()}
    assert not {n: s for n, s in sizes.items() if s > MAX_LINES}


def test_every_package_says_what_it_owns_and_may_import() -> None:
    for name, path in _modules().items():
        if path.name == "__init__.py" and name != "agent":
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            assert len(doc) > 80, f"{name} has no package docstring"


def test_packages_import_only_what_they_may() -> None:
    wrong = []
    for name, path in _modules().items():
        rule = _part(name)
        if not rule:
            continue
        allowed = MAY_IMPORT[rule] | {rule}
        for target in _top_level_imports(path, name):
            if target in ("agent", "agent.threads"):  # the root package (its version) and
                continue  # the one leaf every package may use; not the other subpackages
            if not any(target == a or target.startswith(a + ".") for a in allowed):
                wrong.append(f"{name} imports {target}")
    assert not wrong


def test_no_import_cycles() -> None:
    modules = _modules()
    graph = {
        n: {t for t in _top_level_imports(p, n) if t in modules and t != n}
        for n, p in modules.items()
    }
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                cycles.append(
                    [*trail[trail.index(target) :], target] if target in trail else [node, target]
                )
            elif target not in state:
                visit(target, [*trail, target])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    # A package's __init__ importing its own modules is not a cycle worth naming here.
    cycles = [c for c in cycles if len(set(c)) > 1]
    assert not cycles


def test_paho_private_names_live_in_one_module() -> None:
    """Modules that touch paho (import it, or sit in agent.mqtt) reach none of paho's private
    names, except the one wall module."""
    users = sorted(
        name
        for name, path in _modules().items()
        if name != PAHO_WALL
        and ("paho" in path.read_text() or name.startswith("agent.mqtt"))
        and _uses_paho_privates(path.read_text())
    )
    assert not users, f"paho private names outside {PAHO_WALL}: {users}"


# The private names of paho's Client (2.1 and 2.2) that a subclass could reach.
PAHO_PRIVATE_NAMES = (
    "_sock",
    "_out_packet",
    "_packet_queue",
    "_last_bytes_received",
    "_last_msg_in",
    "_last_msg_out",
    "_in_packet",
    "_packet_handle",
    "_easy_log",
    "_loop_rc_handle",
    "_mid_generate",
    "_out_messages",
    "_out_message_mutex",
    "_pack_remaining_length",
    "_sock_send",
    "_sock_recv",
    "_sock_close",
    "_msgtime_mutex",
    "_do_on_publish",
    "_send_puback",
    "_manual_ack",
    "_protocol",
    "_on_publish",
)


def _uses_paho_privates(text: str) -> bool:
    return any(re.search(rf"\.{re.escape(n)}\b", text) for n in PAHO_PRIVATE_NAMES)
