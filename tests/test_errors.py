"""`WireError` and `Limits`: what every refusal carries, and what limits accept."""

from __future__ import annotations

import pytest

from agent.protocol.errors import ERROR_CODES, Limits, WireError


def test_wire_error_fields() -> None:
    error = WireError("too_large", "line one\nline two", "r-1")
    assert (error.code, error.message, error.request_id) == (
        "too_large",
        "line one line two",
        "r-1",
    )
    assert WireError("bad_request", "x").request_id is None
    with pytest.raises(ValueError):
        WireError("nope", "x")
    assert len(WireError("bad_request", "y" * 10_000).message) <= 300
    assert {
        "bad_request",
        "unknown_model",
        "unknown_version",
        "too_large",
        "overloaded",
        "deadline_exceeded",
        "model_error",
        "shutting_down",
    } == ERROR_CODES


def test_limits_are_validated() -> None:
    assert Limits().max_payload_bytes == 4 * 1024 * 1024
    for bad in ({"max_depth": 0}, {"max_rank": -1}, {"max_tensors": True}):
        with pytest.raises(ValueError):
            Limits(**bad)
