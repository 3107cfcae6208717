"""Which external tensor data an ONNX file may name: only files inside its own version folder.

An ONNX model may keep tensors outside the ``.onnx`` file (``external_data`` with a
``location``), and both ONNX Runtime and TensorRT's parser read whatever the location names.
The agent checks it first, whatever those libraries' own checks are in the installed version,
and says plainly where the file is missing or too short (torch's exporter writes
``model.onnx.data`` beside ``model.onnx``: a user may copy only the one).
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from pathlib import Path, PureWindowsPath
from typing import Any

from agent.models.backends.base import one_line

__all__ = ["external_data_problem"]


def external_data_problem(model_file: Path, *, refuse_unreadable: bool = True) -> str | None:
    """Why ``model_file``'s external tensor data may not be read, or None if it may.

    A tensor stored outside the ``.onnx`` file names its file in ``external_data``
    (``location``), relative to the model's folder. The agent reads only its own version
    folder: a location that is absolute, has a ``..`` component, or resolves (after links)
    outside the folder is refused here, before ONNX Runtime opens anything, whatever ONNX
    Runtime's own checks are in the installed version. The model is parsed without its
    external data; initializers, sparse ones, tensors in node attributes, subgraphs (If,
    Loop, Scan) and functions are all looked at. A permitted file that is not there, or is
    shorter than a tensor's end, is named too. A file that cannot be parsed is refused,
    unless ``refuse_unreadable`` is false (a caller whose own parser reports it better).
    """
    if not _may_name_external_data(model_file):
        return None  # the usual case, without importing onnx (some 13 MB of a small box)
    import onnx

    try:
        model = onnx.load(str(model_file), load_external_data=False)
    except Exception as exc:
        return f"not a readable ONNX model: {one_line(exc)}" if refuse_unreadable else None
    folder = model_file.parent.resolve()
    for tensor in _all_tensors(model):
        entries = {entry.key: entry.value for entry in tensor.external_data}
        location = entries.get("location")
        if location is None:
            continue
        problem = _location_problem(location, folder) or _extent_problem(entries, folder)
        if problem is not None:
            return f"tensor {tensor.name!r}: external data {location!r} {problem}"
    return None


# An external-data entry's key as protobuf writes it: field 1 (key), length 8, "location".
_LOCATION_KEY = b"\x0a\x08location"


def _may_name_external_data(model_file: Path) -> bool:
    """Whether the file's bytes hold an external-data `location` key (a model without one
    has no external data); True where the file cannot be read (the full check reports it)."""
    try:
        with open(model_file, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return m.find(_LOCATION_KEY) >= 0
    except (OSError, ValueError):
        return True


def _location_problem(location: str, folder: Path) -> str | None:
    """Why one external-data ``location`` is refused (``folder``: the resolved version)."""
    parts = location.replace("\\", "/").split("/")
    if not location or "\x00" in location:
        return "is not a file name"
    if location.startswith(("/", "\\")) or PureWindowsPath(location).is_absolute():
        return "is an absolute path (external data must be in the version folder)"
    if ".." in parts:
        return "leaves the version folder (a '..' component)"
    try:
        target = (folder / location).resolve()
    except (OSError, RuntimeError, ValueError):
        return "cannot be resolved"
    if not target.is_relative_to(folder):
        return "resolves outside the version folder"
    return None


def _extent_problem(entries: dict[str, str], folder: Path) -> str | None:
    """Why a tensor's bytes cannot be in its (permitted) external file: the file is not
    there, or is shorter than the tensor's `offset` + `length` (still being copied, or cut
    short): said plainly, before ONNX Runtime's own message."""
    try:
        size = (folder / entries["location"]).stat().st_size
    except OSError:
        return "is not in the version folder: copy it beside the model file"
    try:
        end = int(entries.get("offset", "0")) + int(entries.get("length", "0"))
    except ValueError:
        return None  # ONNX Runtime says what is wrong with the numbers
    if end > size:
        return f"is {size} bytes, the tensor ends at byte {end} (a copy cut short?)"
    return None


def _all_tensors(model: Any) -> Iterator[Any]:
    """Every TensorProto of ``model``: its graph's, nested graphs', and its functions'."""
    yield from _graph_tensors(model.graph)
    for function in model.functions:
        for node in function.node:
            yield from _node_tensors(node)


def _graph_tensors(graph: Any) -> Iterator[Any]:
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield from (sparse.values, sparse.indices)
    for node in graph.node:
        yield from _node_tensors(node)


def _node_tensors(node: Any) -> Iterator[Any]:
    """The tensors in a node's attributes, and those of the graphs it holds (If, Loop)."""
    for attribute in node.attribute:
        if attribute.HasField("t"):
            yield attribute.t
        yield from attribute.tensors
        for sparse in [
            *([attribute.sparse_tensor] if attribute.HasField("sparse_tensor") else []),
            *attribute.sparse_tensors,
        ]:
            yield from (sparse.values, sparse.indices)
        if attribute.HasField("g"):
            yield from _graph_tensors(attribute.g)
        for graph in attribute.graphs:
            yield from _graph_tensors(graph)
