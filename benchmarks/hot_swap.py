"""Hot-swap figures: request latency while versions swap, and memory over load/unload cycles."""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from agent.client import AgentClient, AgentError
from agent.demo import models as demo_models
from agent.models.backends.base import BackendOptions
from agent.models.manager import ModelManager

MODEL = "swap-mlp"


@dataclass
class SwapResult:
    requests_base: int
    requests_swap: int
    swaps: int
    p50_base_ms: float
    p99_base_ms: float
    p50_swap_ms: float
    p99_swap_ms: float
    failed: int
    wrong_version: int

    @property
    def ratio(self) -> float:
        return self.p99_swap_ms / self.p99_base_ms


@dataclass
class MemoryResult:
    cycles: int
    rss_before_mb: float
    rss_after_mb: float

    @property
    def growth_mb(self) -> float:
        return self.rss_after_mb - self.rss_before_mb


def model_bytes(seed: int) -> bytes:
    return demo_models.to_bytes(demo_models.mlp(inputs=64, hidden=256, outputs=16, seed=seed))


def add_model(repository: Path) -> None:
    (repository / MODEL / "1").mkdir(parents=True)
    (repository / MODEL / "1" / "model.onnx").write_bytes(model_bytes(1))


def drop_version(repository: Path, version: int) -> None:
    staging = repository / MODEL / f".{version}.tmp"
    staging.mkdir()
    (staging / "model.onnx").write_bytes(model_bytes(version))
    os.rename(staging, repository / MODEL / str(version))


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def measure_swaps(client: AgentClient, repository: Path, seconds: float, swaps: int) -> SwapResult:
    """One request every 10 ms: `seconds` with no swap, then `seconds` with `swaps` swaps."""
    x = np.random.default_rng(0).standard_normal((1, 64)).astype(np.float32)
    for _ in range(20):
        client.infer(MODEL, {"x": x})

    def run(duration: float, during: threading.Thread | None) -> tuple[list[float], int, int]:
        latencies: list[float] = []
        failed = wrong = 0
        if during is not None:
            during.start()
        end = time.monotonic() + duration
        while time.monotonic() < end:
            started = time.perf_counter()
            try:
                reply = client.request(MODEL, {"x": x}, timeout=10)
                chunks = list(reply)
                latencies.append(time.perf_counter() - started)
                if len(chunks) != 1 or reply.version is None:
                    wrong += 1
            except AgentError:
                failed += 1
            time.sleep(max(0.0, 0.01 - (time.perf_counter() - started)))
        if during is not None:
            during.join()
        return latencies, failed, wrong

    base, failed_base, wrong_base = run(seconds, None)

    def swapper() -> None:
        for version in range(2, swaps + 2):
            time.sleep(seconds / (swaps + 1))
            drop_version(repository, version)

    during, failed_swap, wrong_swap = run(seconds, threading.Thread(target=swapper))
    return SwapResult(
        requests_base=len(base),
        requests_swap=len(during),
        swaps=swaps,
        p50_base_ms=statistics.median(base) * 1000,
        p99_base_ms=_p(base, 0.99),
        p50_swap_ms=statistics.median(during) * 1000,
        p99_swap_ms=_p(during, 0.99),
        failed=failed_base + failed_swap,
        wrong_version=wrong_base + wrong_swap,
    )


def rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def measure_memory(workdir: Path, cycles: int) -> MemoryResult:
    """Load a new version, swap to it, unload the old one: `cycles` times, in this process."""
    repository = workdir / "memory-models"
    (repository / "m").mkdir(parents=True)
    (repository / "m" / "config.toml").write_text("[policy]\nkeep_loaded = 0\n")
    manager = ModelManager(repository, BackendOptions(intra_op_threads=1), settle_s=0.0)
    data = model_bytes(1)
    x = {"x": np.ones((1, 64), dtype=np.float32)}

    def cycle(version: int) -> None:
        folder = repository / "m" / str(version)
        staging = repository / "m" / f".{version}.tmp"
        staging.mkdir()
        (staging / "model.onnx").write_bytes(data)
        os.rename(staging, folder)
        manager.mark_complete(folder)
        manager.sync()
        with manager.lease("m") as lease:
            lease.session.run(x)
        old = repository / "m" / str(version - 1)
        if old.exists():
            shutil.rmtree(old)
        manager.sync()

    for version in range(1, 31):  # warm-up: allocator pools, ORT's one-time state
        cycle(version)
    gc.collect()
    before = rss_mb()
    for version in range(31, 31 + cycles):
        cycle(version)
    gc.collect()
    after = rss_mb()
    manager.close()
    return MemoryResult(cycles, before, after)


def section(swap: SwapResult, memory: MemoryResult) -> list[str]:
    ratio_ok = "met" if swap.ratio <= 2 else "**missed**"
    failed_ok = "met" if swap.failed == 0 and swap.wrong_version == 0 else "**missed**"
    memory_ok = "met" if memory.growth_mb <= 10 else "**missed**"
    return [
        "## Hot swap",
        "",
        f"One request every 10 ms to an MLP (64-256-16): {swap.requests_base} requests with no "
        f"swap, then {swap.requests_swap} requests while {swap.swaps} new versions were dropped "
        "into the watched folder (each loaded, warmed up and swapped in by the agent while "
        "serving). Memory: the same load / swap / unload cycle run in one process "
        f"({memory.cycles} cycles after 30 warm-up cycles), resident set size before and after.",
        "",
        "| figure | value | target |",
        "|---|---|---|",
        f"| p50 latency, no swap / during swaps | {swap.p50_base_ms:.2f} ms / "
        f"{swap.p50_swap_ms:.2f} ms | report |",
        f"| p99 latency, no swap / during swaps | {swap.p99_base_ms:.2f} ms / "
        f"{swap.p99_swap_ms:.2f} ms | report |",
        f"| p99 during swaps / p99 without | **{swap.ratio:.2f}** | <= 2 {ratio_ok} |",
        f"| failed requests (errors + wrong replies) | **{swap.failed + swap.wrong_version}** "
        f"| 0 {failed_ok} |",
        f"| resident memory growth over {memory.cycles} load/swap/unload cycles | "
        f"**{memory.growth_mb:+.1f} MB** ({memory.rss_before_mb:.0f} -> "
        f"{memory.rss_after_mb:.0f} MB) | <= 10 MB {memory_ok} |",
        "",
    ]
