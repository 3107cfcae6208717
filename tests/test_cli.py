"""The `edge-agent` commands as an operator runs them: real processes, a real broker."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

CLI = [sys.executable, "-m", "agent.cli"]
ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}


def run_cli(*args: str, timeout: float = 30, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=timeout, env=ENV, **kw
    )


def test_check_config_prints_masked_config(tmp_path: Path):
    (tmp_path / "models").mkdir()
    (tmp_path / "secret.txt").write_text("hunter2\n")
    path = tmp_path / "agent.toml"
    path.write_text(
        'device_id = "box-1"\n[mqtt]\nusername = "agent"\npassword_file = "secret.txt"\n'
        '[models]\nrepository = "models"\n'
    )
    result = run_cli("check-config", "--config", str(path))
    assert result.returncode == 0, result.stderr
    assert 'device_id = "box-1"' in result.stdout
    assert 'password_file = "***"' in result.stdout
    assert "secret.txt" not in result.stdout and "hunter2" not in result.stdout
    assert f'repository = "{tmp_path / "models"}"' in result.stdout
    # empty in the file, shown as they take effect
    assert 'client_id = "edge-agent-box-1"' in result.stdout
    assert 'allowed_reply_prefixes = ["edge/box-1/result/"]' in result.stdout


def test_check_config_one_line_per_problem(tmp_path: Path):
    path = tmp_path / "agent.toml"
    path.write_text("[mqtt]\nport = 99999\nbogus = 1\n[scheduler]\nworkers = 0\n")
    result = run_cli("check-config", "--config", str(path))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 3
    assert all(line.startswith(f"error: {path}: ") for line in lines)
    assert any("unknown key 'mqtt.bogus'" in line for line in lines)
    assert any("mqtt.port" in line for line in lines)
    assert any("scheduler.workers" in line for line in lines)


def test_check_config_reports_missing_repository(tmp_path: Path):
    path = tmp_path / "agent.toml"
    path.write_text('[models]\nrepository = "nowhere"\n')
    result = run_cli("check-config", "--config", str(path))
    assert result.returncode == 2 and "models.repository: folder not found" in result.stderr


def test_run_request_subscribe_models(broker, repository, tmp_path: Path):
    config = tmp_path / "agent.toml"
    config.write_text(
        f'device_id = "cli-box"\nstate_dir = "{tmp_path / "state"}"\n'
        f'[mqtt]\nhost = "{broker.host}"\nport = {broker.port}\n'
        f'[models]\nrepository = "{repository}"\n'
    )
    agent = subprocess.Popen(
        [*CLI, "run", "--config", str(config), "--log-format", "json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        subscriber = subprocess.Popen(
            [*CLI, "subscribe", "--config", str(config), "--count", "5", "--duration", "20"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
        )
        np.save(tmp_path / "token.npy", np.array([[1]], dtype=np.int64))
        models = run_cli("models", "--config", str(config), "--timeout", "10")
        assert models.returncode == 0, models.stderr
        assert '"serving": 1' in models.stdout
        result = run_cli(
            "request",
            "--config",
            str(config),
            "decoder",
            "--input",
            f"token={tmp_path / 'token.npy'}",
            "--param",
            "max_steps=3",
        )
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        assert sum(" chunk seq=" in line for line in lines) == 3
        assert any("end chunks=3" in line for line in lines)
        assert "first chunk" in lines[-1]
        bad = run_cli(
            "request",
            "--config",
            str(config),
            "nosuch",
            "--input",
            f"token={tmp_path / 'token.npy'}",
            "--timeout",
            "5",
        )
        assert bad.returncode == 1 and "unknown_model" in bad.stderr
        out, _ = subscriber.communicate(timeout=25)
        assert "edge/cli-box/status" in out and "online" in out
    finally:
        agent.terminate()
        out, err = agent.communicate(timeout=20)
    assert agent.returncode == 0, err[-2000:]
    assert '"msg": "stopped"' in err
    assert all(line.startswith("{") for line in err.strip().splitlines())


def test_local_models_listing(repository, tmp_path: Path):
    config = tmp_path / "agent.toml"
    config.write_text(f'[models]\nrepository = "{repository}"\n')
    result = run_cli("models", "--local", "--config", str(config))
    assert result.returncode == 0
    assert "decoder" in result.stdout and "v1  onnxruntime" in result.stdout


def test_malloc_arenas_are_capped_unless_the_environment_sets_them(monkeypatch):
    """`edge-agent run` caps glibc's arenas (a long-running process with many threads
    fragments them); an operator's MALLOC_ARENA_MAX wins."""
    import platform

    from agent.cli import limit_malloc_arenas

    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert not limit_malloc_arenas()
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    on_glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert limit_malloc_arenas() == on_glibc


def test_request_inputs_take_arrays_images_and_texts(tmp_path: Path):
    import pytest

    from agent.cli_values import parse_inputs

    np.save(tmp_path / "x.npy", np.arange(3, dtype=np.int64))
    (tmp_path / "photo.jpg").write_bytes(b"\xff\xd8not-checked-here")
    inputs = parse_inputs(
        [f"x={tmp_path / 'x.npy'}", f"image={tmp_path / 'photo.jpg'}"],
        ["prompt=The little robot = a story"],
    )
    assert inputs["prompt"] == "The little robot = a story"  # split at the first "=" only
    assert inputs["image"] == b"\xff\xd8not-checked-here"
    assert inputs["x"].tolist() == [0, 1, 2]
    pairs = parse_inputs([], ["prompt=q", "pair=first passage", "pair=second"])
    assert pairs["prompt"] == "q" and pairs["pair"].tolist() == ["first passage", "second"]
    with pytest.raises(SystemExit, match="--text needs NAME=TEXT"):
        parse_inputs([], ["no-equals-sign"])
    conversation = parse_inputs([], [], ["system=Be brief.", "user=Hi = hello"])["messages"]
    assert conversation.tolist() == [["system", "Be brief."], ["user", "Hi = hello"]]
    with pytest.raises(SystemExit, match="--message needs ROLE=TEXT"):
        parse_inputs([], [], ["no-role"])


def test_request_inputs_from_an_npz_archive_and_clear_errors_for_bad_files(tmp_path: Path):
    import pytest

    from agent.cli_values import parse_inputs

    archive = tmp_path / "inputs.npz"
    np.savez(archive, token=np.array([[7]], dtype=np.int64), h=np.zeros((1, 8), np.float32))
    inputs = parse_inputs([f"token={archive}", f"h={archive}"])
    assert inputs["token"].tolist() == [[7]] and inputs["h"].shape == (1, 8)
    with pytest.raises(SystemExit, match=r"holds no array named 'x' \(it holds: token, h\)"):
        parse_inputs([f"x={archive}"])
    (tmp_path / "empty.npy").write_bytes(b"")
    with pytest.raises(SystemExit, match=r"cannot read .*empty\.npy: \S"):
        parse_inputs([f"x={tmp_path / 'empty.npy'}"])
    with pytest.raises(SystemExit, match=r"cannot read .*missing\.npy"):
        parse_inputs([f"x={tmp_path / 'missing.npy'}"])


def test_request_inputs_from_a_wav_file(tmp_path: Path):
    """16-bit stereo at 16 kHz: the channels averaged, in [-1, 1); 8-bit is unsigned; another
    rate is refused with the resampling command."""
    import wave

    import pytest

    from agent.cli_values import parse_inputs

    def write(path: Path, rate: int, width: int, channels: int, frames: bytes) -> None:
        with wave.open(str(path), "wb") as file:
            file.setnchannels(channels)
            file.setsampwidth(width)
            file.setframerate(rate)
            file.writeframes(frames)

    stereo = np.array([[16384, 0], [-32768, -32768], [100, 300]], dtype="<i2")
    write(tmp_path / "a.wav", 16000, 2, 2, stereo.tobytes())
    samples = parse_inputs([f"input_values={tmp_path / 'a.wav'}"])["input_values"]
    assert samples.dtype == np.float32
    assert samples.tolist() == [0.25, -1.0, 200 / 32768]
    write(tmp_path / "b.wav", 16000, 1, 1, bytes([128, 255, 0]))
    assert parse_inputs([f"x={tmp_path / 'b.wav'}"])["x"].tolist() == [0.0, 127 / 128, -1.0]
    write(tmp_path / "c.wav", 44100, 2, 1, b"\0\0")
    with pytest.raises(SystemExit, match=r"is 44100 Hz; .*ffmpeg -i \S+c\.wav -ar 16000"):
        parse_inputs([f"x={tmp_path / 'c.wav'}"])
    (tmp_path / "d.wav").write_bytes(b"RIFF")
    with pytest.raises(SystemExit, match=r"cannot read \S+d\.wav"):
        parse_inputs([f"x={tmp_path / 'd.wav'}"])


def test_subscribe_names_a_message_without_a_type_by_its_topic():
    from agent.cli_client import _summarize_message

    assert _summarize_message("edge/x/telemetry", {"epoch": 1}).startswith("telemetry ")
    assert _summarize_message("edge/x/status", {"state": "online"}).startswith("online ")
    assert _summarize_message("edge/x/result/m/r1", {"type": "chunk"}).startswith("chunk ")


def test_bad_arguments_are_one_line_not_a_traceback(tmp_path: Path):
    """A negative timeout, a models folder that is not there, a backoff upside down: each a
    one-line error (a ValueError or FileNotFoundError traceback before)."""
    path = tmp_path / "agent.toml"
    path.write_text('[models]\nrepository = "nowhere"\n')
    timeout = run_cli("health", "--config", str(path), "--timeout", "-1")
    assert timeout.returncode == 2 and "not a positive number of seconds" in timeout.stderr
    local = run_cli("models", "--config", str(path), "--local")
    assert local.returncode == 2 and "models.repository: folder not found" in local.stderr
    assert "Traceback" not in timeout.stderr + local.stderr
    path.write_text("[mqtt]\nreconnect_min_s = 10\nreconnect_max_s = 1\n")
    upside_down = run_cli("check-config", "--config", str(path), "--quiet")
    assert upside_down.returncode == 2
    assert "reconnect_max_s must be >= reconnect_min_s" in upside_down.stderr
