"""The benchmarks' own machinery: the minimal MQTT client (benchmarks.lean_mqtt) that drives the
batching figure must speak MQTT to a real Mosquitto as paho does, the sources figure's
estimator must cancel the drift it is there to cancel, or the figures measure nothing, and the
reports written from saved results must have the shape the docs link to."""

from __future__ import annotations

import json
import os
import statistics
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from agent.demo.broker import EmbeddedBroker
from benchmarks import run
from benchmarks.harness import cpu_s
from benchmarks.lean_mqtt import PUBLISH, LeanClient, parse_publish, puback
from benchmarks.sources import paired_ratio, turn_rate


def test_lean_client_publishes_and_reads_back_at_qos_0_and_1(broker: EmbeddedBroker) -> None:
    topic = f"test/lean/{uuid.uuid4().hex}"
    client = LeanClient(broker.host, broker.port, f"lean-{uuid.uuid4().hex[:8]}")
    try:
        client.subscribe(f"{topic}/#", 1)
        sent = [(f"{topic}/{i}", bytes([i % 256]) * (i * 997), i % 2) for i in range(40)]
        client.sock.sendall(b"".join(client.publish_packet(t, p, q) for t, p, q in sent))
        got: list[tuple[str, bytes, int]] = []
        acks, expected_acks = 0, sum(q for _, _, q in sent)
        deadline = time.monotonic() + 10
        while (len(got) < len(sent) or acks < expected_acks) and time.monotonic() < deadline:
            out = []
            for first, body in client.read(0.5):
                if first >> 4 == PUBLISH:
                    mid, payload = parse_publish(first, body)
                    name = body[2 : 2 + (body[0] << 8 | body[1])].decode()
                    got.append((name, payload, (first >> 1) & 3))
                    if mid is not None:
                        out.append(puback(mid))
                elif first >> 4 == 4:
                    acks += 1  # the broker's PUBACK of one of ours
            client.sock.sendall(b"".join(out))
        # Payloads up to 39 kB: remaining lengths of one to three bytes, reads cut anywhere.
        assert got == sent
        assert acks == expected_acks
    finally:
        client.close()


def test_cpu_time_of_a_process_counts_its_work() -> None:
    """The batching figure's CPU per request comes from this reading of /proc."""
    before = cpu_s(os.getpid())
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:
        pass
    spent = cpu_s(os.getpid()) - before
    assert 0.2 <= spent <= 5.0


def test_paired_ratio_follows_the_machine_where_a_ratio_of_medians_does_not() -> None:
    """The machine slows down half way (100 fps, then 70); the agent runs at 0.9 of whatever
    the bare loop gets at the time."""
    speed = [100.0] * 10 + [70.0] * 11
    bare = speed[0::2]  # bare, agent, bare, agent, ..., bare: 11 bare turns, 10 agent turns
    agent = [0.9 * s for s in speed[1::2]]
    assert paired_ratio(agent, bare) == pytest.approx(0.9)
    # The medians fall on different sides of the change: the agent looks faster than bare.
    assert statistics.median(agent) / statistics.median(bare) == pytest.approx(76.5 / 70)
    # A turn caught half in a slow phase is one outlier among the pairs, not a shift.
    agent[3] = 40.0
    assert paired_ratio(agent, bare) == pytest.approx(0.9)
    with pytest.raises(ValueError, match="one reference turn before each"):
        paired_ratio(agent, bare[:-1])


def test_turn_rate_is_frames_over_the_emit_times_they_span() -> None:
    second = 1_000_000_000
    frames = [(i * 2, 5 * second + i * second // 50) for i in range(26)]  # 50 fps, 25 periods
    assert turn_rate(frames) == pytest.approx(50.0)
    assert turn_rate(frames[:1]) == 0.0  # a stalled agent counts as a zero-rate turn


def _prose(text: str) -> list[str]:
    """The lines of a Markdown text outside tables and fenced code."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and not line.startswith("|"):
            lines.append(line)
    return lines


def test_wrap_markdown_wraps_prose_and_keeps_tables_code_and_words() -> None:
    words = [f"word{i}" for i in range(60)]
    # Markers at many offsets: some fall where a plain wrap would start a line with them.
    paragraphs = [" ".join([*words[:k], "- 1. > #", *words[k:]]) for k in range(20, 40)]
    starts_block = ("-", "1.", ">", "#")
    plain = [line for p in paragraphs for line in textwrap.wrap(p, 40)[1:]]
    assert any(line.split()[0] in starts_block for line in plain)  # the case exists
    paragraph = "\n\n".join(paragraphs)
    table = "| a | b |\n|---|---|\n| " + "x" * 150 + " | y |"
    code = "```\n" + "c " * 80 + "\n```"
    item = "- " + " ".join(words)
    text = "\n".join(["# " + "h" * 120, "", paragraph, "", table, "", code, "", item])
    wrapped = run.wrap_markdown(text, width=40)
    assert wrapped.split() == text.split()  # same words, same order
    assert table in wrapped and code in wrapped and "# " + "h" * 120 in wrapped
    starts = {"# " + "h" * 120, item[:40].rsplit(" ", 1)[0]}  # the heading, the item's first
    for line in _prose(wrapped):
        if line in starts:
            continue
        assert len(line) <= 40, line
        # a continuation line never starts a list item, a quote or a heading
        assert line.split()[:1] not in [[s] for s in starts_block], line
    item_lines = wrapped[wrapped.index("- word0") :].splitlines()
    assert len(item_lines) > 1 and all(line.startswith("  word") for line in item_lines[1:])


def test_report_from_saved_results_keeps_the_current_tables_and_links_the_history(
    tmp_path: Path,
) -> None:
    """`run.py --report-only`: docs/benchmarks.md holds the latest run of every saved section
    and links the generated history, which holds one row per measured revision."""
    (tmp_path / run.PLOT).write_bytes(b"png")  # the figure already there is linked, not drawn
    written = run.write_report(tmp_path / "benchmarks.md", plot=False)
    report = (tmp_path / "benchmarks.md").read_text()
    history_doc = tmp_path / run.HISTORY_DOC
    assert written == [tmp_path / "benchmarks.md", history_doc]
    for heading in ("## Speed against the baselines", "## Hot swap", "## Local sources"):
        assert heading in report
    assert "What each optimisation gained" not in report
    assert f"]({run.HISTORY_DOC})" in report and f"]({run.PLOT})" in report
    history = json.loads((run.RESULTS / "history.json").read_text())
    rows = [line for line in history_doc.read_text().splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == [r["rev"] for r in history["rows"]]
    assert "](benchmarks.md)" in history_doc.read_text()
    for text in (report, history_doc.read_text()):
        assert all(len(line) <= run.WIDTH for line in _prose(text))


def test_image_bench_loop_by_hand_makes_what_the_agent_makes(tmp_path: Path) -> None:
    """The images figure compares like with like: the seeded scene gives the same JPEG every
    run, and the loop by hand (cv2.resize + copyMakeBorder, the session, `detect`) gives the
    model the tensor the agent's `[preprocess]` gives it and the boxes its `[[postprocess]]`
    gives, both read from the config the benchmark installs."""
    cv2 = pytest.importorskip("cv2")
    import numpy as np

    from agent.models.model_config import parse_model_config
    from agent.models.postprocess import build_postprocess
    from agent.models.preprocess import preprocess_image
    from benchmarks import images

    image = images.jpeg(images.scene())
    assert image == images.jpeg(images.scene()) and len(image) > 100_000
    pixels = cv2.imdecode(np.frombuffer(image, np.uint8), cv2.IMREAD_COLOR)
    assert pixels.shape == (*images.SIZE, 3)
    images.add_model(tmp_path)
    config = parse_model_config((tmp_path / images.MODEL / "config.toml").read_text(), "bench")
    assert config.preprocess is not None
    expected, geometry = preprocess_image(pixels, config.preprocess, bgr=True)
    tensor, hand_geometry = images.HandPipeline.letterbox(pixels)
    assert hand_geometry == geometry and geometry.pad == (35, 0)
    np.testing.assert_array_equal(tensor, expected)
    hand = images.HandPipeline()
    post = build_postprocess(config.postprocess, ["output0"], tmp_path / images.MODEL / "1")
    assert post is not None
    (raw,) = hand.session.run(None, {images.INPUT: expected})
    agent = post.apply({"output0": raw}, geometry)
    got = hand.run(image)
    assert len(got["boxes"]) > 0
    for key in ("boxes", "scores", "classes", "labels"):
        np.testing.assert_array_equal(got[key], agent[key])
    template = images.request_template(image)
    assert template.count(images.MARKER.encode()) == 1  # what the load peer replaces


def test_by_host_keeps_the_latest_full_run_of_each_host_and_reports_each(tmp_path: Path) -> None:
    """A run replaces its host's earlier run of the section, not another host's; a quick run
    is not kept; the report's table has a row per section and host with its verdict."""
    from benchmarks import by_host

    path = tmp_path / "by-host.json"

    def record(cpu: str, ratio: float, date: str, quick: bool = False) -> dict[str, object]:
        data = {
            "results": [
                {
                    "windows_per_chunk": 1,
                    "windows": 10,
                    "bare_wps": 100.0,
                    "agent_wps": 100.0 * ratio,
                    "ratio": ratio,
                }
            ]
        }
        return {
            "date": date,
            "quick": quick,
            "commit": "abc1234",
            "machine": f"{cpu}, 2 cores, Linux 6",
            "data": data,
        }

    by_host.remember(path, "scan", record("Host A", 0.5, "2026-01-01"))
    by_host.remember(path, "scan", record("Host B", 0.95, "2026-01-02"))
    by_host.remember(path, "scan", record("Host A", 0.6, "2026-01-03"))
    by_host.remember(path, "scan", record("Host B", 0.1, "2026-01-04", quick=True))
    runs = by_host.load(path)
    assert {h: r["date"] for h, r in runs["scan"].items()} == {
        "Host A": "2026-01-03",
        "Host B": "2026-01-02",
    }
    lines = by_host.lines(runs, list(run.SECTIONS), run._record_met, run.headline)
    rows = [line for line in lines if line.startswith("| `scan`")]
    assert rows == [
        "| `scan` | Host A | 2026-01-03, `abc1234` | source x0.60 | **missed** |",
        "| `scan` | Host B | 2026-01-02, `abc1234` | source x0.95 | met |",
    ]


def test_reuse_section_measures_what_it_names(broker: EmbeddedBroker, tmp_path: Path) -> None:
    """The reuse figures compare the settings they name: the cached side took the shared
    beginning from the prefix cache, the lookup side's runs gave at least a token each, and
    the section reads back from its saved form."""
    from benchmarks import reuse

    result = reuse.measure(broker, tmp_path, quick=True)
    assert result.cached_tokens == reuse.SHARED
    assert result.tokens_a_run >= 1.0 and result.rounds == 5
    assert result.first_token_ms > 0 and result.lookup_tokens_s > 0
    lines = reuse.section(reuse.from_json(json.loads(json.dumps(reuse.to_json(result)))))
    assert lines[0] == "## Reuse: the prefix cache and prompt lookup"
    assert any(f"{reuse.SHARED} tokens from the cache" in line for line in lines)
