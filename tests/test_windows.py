"""The windowing of a scan (agent.inference.windows): pushing a signal in pieces of any size
gives the windows of pushing it at once; lead, tail, a batch axis; bounded memory."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from agent.inference.windows import Windower


def plain_windows(
    signal: npt.NDArray[Any], window: int, hop: int, lead: int, tail: str = "drop"
) -> list[tuple[int, npt.NDArray[Any]]]:
    """Window k = signal[k*hop - lead : k*hop - lead + window], zeros outside the signal."""
    padded = np.concatenate([np.zeros(lead, signal.dtype), signal, np.zeros(window, signal.dtype)])
    found = []
    k = 0
    while k * hop - lead + window <= len(signal):
        found.append((k * hop, padded[k * hop : k * hop + window]))
        k += 1
    covered = (k - 1) * hop - lead + window if k else 0
    if tail == "pad" and len(signal) > covered:
        found.append((k * hop, padded[k * hop : k * hop + window]))
    return found


def pushed(
    w: Windower, signal: npt.NDArray[Any], sizes: list[int]
) -> list[tuple[int, npt.NDArray[Any]]]:
    along = np.moveaxis(signal, w.axis, -1)  # pieces along the windower's axis
    found = []
    start = 0
    for size in sizes:
        found += w.push(np.moveaxis(along[..., start : start + size], -1, w.axis))
        start += size
    found += w.push(np.moveaxis(along[..., start:], -1, w.axis))
    return found


def assert_same(a: list[tuple[int, Any]], b: list[tuple[int, Any]]) -> None:
    assert [o for o, _ in a] == [o for o, _ in b]
    for (_, x), (_, y) in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize(
    ("window", "hop", "lead"), [(576, 512, 64), (10, 3, 0), (8, 8, 2), (5, 1, 4)]
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pieces_of_any_size_give_the_windows_of_one_push(
    window: int, hop: int, lead: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    signal = rng.standard_normal(int(rng.integers(0, 5000))).astype(np.float32)
    once = Windower(window, hop, lead).push(signal)
    sizes = list(rng.integers(0, 700, size=20))
    assert_same(pushed(Windower(window, hop, lead), signal, sizes), once)
    assert_same(once, plain_windows(signal, window, hop, lead))


def test_lead_puts_zeros_before_the_first_window() -> None:
    signal = np.arange(1, 1201, dtype=np.float32)
    found = Windower(576, 512, 64).push(signal)
    assert [o for o, _ in found] == [0, 512]  # the next window needs samples up to 1536
    first, second = found[0][1], found[1][1]
    np.testing.assert_array_equal(first[:64], 0)
    np.testing.assert_array_equal(first[64:], signal[:512])
    np.testing.assert_array_equal(second, signal[448:1024])


@pytest.mark.parametrize("length", [0, 1, 511, 512, 513, 1024, 1100])
def test_tail_pad_gives_the_last_partial_window_and_drop_none(length: int) -> None:
    signal = np.arange(1, length + 1, dtype=np.float32)
    w = Windower(576, 512, 64)
    found = w.push(signal)
    assert w.finish("drop") == []
    assert w.consumed == 0  # finish resets
    w = Windower(576, 512, 64)
    padded = w.push(signal) + w.finish("pad")
    assert_same(padded, plain_windows(signal, 576, 512, 64, "pad"))
    expected = -(-length // 512)  # every sample in some window's new samples
    assert len(padded) == expected
    if len(padded) > len(found):
        offset, last = padded[-1]
        assert offset == 512 * (expected - 1)
        assert last.shape == (576,)
        kept = length - offset
        np.testing.assert_array_equal(last[64 : 64 + kept], signal[offset:])
        np.testing.assert_array_equal(last[64 + kept :], 0)


def test_consumed_counts_the_samples_before_the_next_window() -> None:
    w = Windower(576, 512, 64)
    assert w.consumed == 0
    w.push(np.zeros(1000, np.float32))
    assert w.consumed == 512
    w.push(np.zeros(100, np.float32))
    assert w.consumed == 1024
    w.reset()
    assert w.consumed == 0


def test_a_batch_of_recordings_along_the_last_axis() -> None:
    rng = np.random.default_rng(3)
    signal = rng.standard_normal((2, 3000)).astype(np.float32)
    found = pushed(Windower(576, 512, 64), signal, [100, 1000, 7])
    assert all(w.shape == (2, 576) for _, w in found)
    for row in range(2):
        one = Windower(576, 512, 64).push(signal[row])
        assert_same([(o, w[row]) for o, w in found], one)


def test_windows_along_another_axis() -> None:
    rng = np.random.default_rng(4)
    signal = rng.standard_normal((300, 3)).astype(np.float32)  # samples first, 3 channels
    found = pushed(Windower(20, 10, 5, axis=0), signal, [7, 50])
    assert all(w.shape == (20, 3) for _, w in found)
    for channel in range(3):
        one = Windower(20, 10, 5).push(signal[:, channel])
        assert_same([(o, w[:, channel]) for o, w in found], one)


def test_memory_is_a_window_plus_one_push() -> None:
    w = Windower(576, 512, 64)
    for _ in range(50):
        w.push(np.zeros(10_000, np.float32))
        assert w.pending_bytes < 576 * 4


def test_a_push_must_continue_the_other_axes() -> None:
    w = Windower(10, 5)
    w.push(np.zeros((2, 7), np.float32))
    with pytest.raises(ValueError, match="do not continue"):
        w.push(np.zeros((3, 7), np.float32))


@pytest.mark.parametrize(("window", "hop", "lead"), [(0, 1, 0), (4, 5, 0), (4, 0, 0), (4, 2, -1)])
def test_impossible_windows_are_refused(window: int, hop: int, lead: int) -> None:
    with pytest.raises(ValueError):
        Windower(window, hop, lead)
