"""Whether a loaded model fits: its own ``config.toml``, and the version it would replace.

Both checks run on a freshly loaded session before it may serve (the manager closes it and
marks the version ``failed`` with these lines otherwise). Each problem is one line that
names the tensor and what differs, so the inventory says exactly what to fix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from agent.models.backends.base import Dim, Session, TensorSpec
from agent.models.defaults import default_problems
from agent.models.model_config import ModelConfig, ScanConfig, TensorDecl

__all__ = ["check_signature", "incompatibilities", "request_inputs"]

RECORDING = "recording"  # a scan request's dim along the windows' axis: any length


def check_signature(config: ModelConfig, session: Session) -> list[str]:
    """What in ``config`` does not fit the loaded model; empty when it all fits."""
    inputs = {spec.name: spec for spec in session.inputs}
    outputs = {spec.name: spec for spec in session.outputs}
    problems: list[str] = []
    for role, declared, actual in (
        ("input", config.inputs, inputs),
        ("output", config.outputs, outputs),
    ):
        for name, decl in declared.items():
            spec = actual.get(name)
            if spec is None:
                problems.append(f"declared {role} {name!r} is not in the model ({_names(actual)})")
            else:
                problems.extend(_compare_decl(role, decl, spec))
    stream = config.stream
    for kind, links in (("feed", stream.feed), ("state", stream.state)):
        for dst, src in links.items():
            problems.extend(_check_link(kind, dst, src, inputs, outputs))
    pre = config.preprocess
    if pre is not None and pre.input is not None and pre.input not in inputs:
        problems.append(f"preprocess input {pre.input!r} is not a model input ({_names(inputs)})")
    if stream.stop is not None and stream.stop.output not in outputs:
        problems.append(f"stop output {stream.stop.output!r} is not a model output")
    for name in stream.emit or ():
        if name not in outputs:
            problems.append(f"emit output {name!r} is not a model output ({_names(outputs)})")
    if stream.mode == "batch":
        for spec in session.inputs:
            if spec.rank == 0:
                problems.append(
                    f"batch mode slices the leading axis, but input {spec.name!r} is a scalar"
                )
    if config.scan is not None:
        problems.extend(_scan_problems(config.scan, inputs))
    problems.extend(default_problems(config.defaults, session.inputs))
    if config.batching.enabled and stream.mode != "generate":  # generate: `loading` checks it
        for role, specs in (("input", session.inputs), ("output", session.outputs)):
            for spec in specs:
                if spec.rank == 0 or isinstance(spec.shape[0], int):
                    problems.append(
                        f"[batching] needs a symbolic leading axis on every input and output; "
                        f"{role} {spec.describe()} has none"
                    )
    return problems


def _scan_problems(scan: ScanConfig, inputs: Mapping[str, TensorSpec]) -> list[str]:
    """The `[scan] input` exists, has the axis, and a fixed size there is the window."""
    spec = inputs.get(scan.input)
    if spec is None:
        return [f"[scan] input {scan.input!r} is not a model input ({_names(inputs)})"]
    if not -spec.rank <= scan.axis < spec.rank:
        return [f"[scan] axis {scan.axis} is not an axis of input {spec.describe()}"]
    size = spec.shape[scan.axis]
    if isinstance(size, int) and size != scan.window:
        return [f"[scan] window {scan.window} does not fit input {spec.describe()}"]
    return []


def request_inputs(specs: Sequence[TensorSpec], config: ModelConfig) -> tuple[TensorSpec, ...]:
    """The inputs a request is checked against: the model's, but a scan's `[scan] input`
    takes a recording of any length along the windows' axis, where the model may fix the
    window's size (`_scan_problems` checked that size against `[scan] window` at load)."""
    scan = config.scan if config.stream.mode == "scan" else None
    if scan is None:
        return tuple(specs)
    return tuple(_recording(spec, scan) if spec.name == scan.input else spec for spec in specs)


def _recording(spec: TensorSpec, scan: ScanConfig) -> TensorSpec:
    if not spec.rank:
        return spec
    axis = scan.axis % spec.rank
    shape = (*spec.shape[:axis], RECORDING, *spec.shape[axis + 1 :])
    return dataclasses.replace(spec, shape=shape)


def _names(specs: Mapping[str, TensorSpec]) -> str:
    return "it has " + (", ".join(specs) or "none")


def _compare_decl(role: str, decl: TensorDecl, spec: TensorSpec) -> list[str]:
    problems: list[str] = []
    if spec.dtype.name != decl.dtype:
        has = spec.dtype.name if spec.is_numeric else spec.onnx_type
        problems.append(f"{role} {spec.name!r}: declared {decl.dtype}, model has {has}")
    if len(decl.shape) != spec.rank:
        problems.append(
            f"{role} {spec.name!r}: declared rank {len(decl.shape)}, model has {spec.describe()}"
        )
    else:
        for i, (want, have) in enumerate(zip(decl.shape, spec.shape, strict=True)):
            if isinstance(want, int) and isinstance(have, int) and want != have:
                problems.append(f"{role} {spec.name!r}: dim {i} declared {want}, model has {have}")
    return problems


def _check_link(
    kind: str,
    dst: str,
    src: str,
    inputs: Mapping[str, TensorSpec],
    outputs: Mapping[str, TensorSpec],
) -> list[str]:
    """``dst`` (an input) gets ``src`` (an output of the previous step): both exist, same type."""
    problems: list[str] = []
    if dst not in inputs:
        problems.append(f"{kind} input {dst!r} is not a model input ({_names(inputs)})")
    if src not in outputs:
        problems.append(f"{kind} output {src!r} is not a model output ({_names(outputs)})")
    if problems:
        return problems
    a, b = inputs[dst], outputs[src]
    if a.dtype != b.dtype or a.onnx_type != b.onnx_type:
        problems.append(f"{kind} {dst} <- {src}: {a.dtype.name} input, {b.dtype.name} output")
    elif a.rank != b.rank or any(
        _dims_conflict(x, y) for x, y in zip(a.shape, b.shape, strict=True)
    ):
        problems.append(f"{kind} {dst} <- {src}: shapes differ ({a.describe()}; {b.describe()})")
    return problems


def _dims_conflict(a: Dim, b: Dim) -> bool:
    return isinstance(a, int) and isinstance(b, int) and a != b


def incompatibilities(old: Session, new: Session, old_version: int) -> list[str]:
    """How `new` differs from the version it would replace, in what requests and replies see."""
    problems = []
    for role, before, after in (
        ("input", old.inputs, new.inputs),
        ("output", old.outputs, new.outputs),
    ):
        was = {s.name: s for s in before}
        now = {s.name: s for s in after}
        if set(was) != set(now):
            problems.append(f"{role}s {sorted(now)} differ from v{old_version}'s {sorted(was)}")
            continue
        for name, spec in now.items():
            prior = was[name]
            fixed_differ = any(
                isinstance(a, int) and isinstance(b, int) and a != b
                for a, b in zip(prior.shape, spec.shape, strict=False)
            )
            differ = spec.dtype != prior.dtype or spec.onnx_type != prior.onnx_type
            if differ or spec.rank != prior.rank or fixed_differ:
                problems.append(
                    f"{role} {spec.describe()} is incompatible with v{old_version}'s "
                    f"{prior.describe()}"
                )
    return problems
