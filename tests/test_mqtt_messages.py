"""The plain values of `agent.mqtt.messages`: reply properties and packed topics."""

from __future__ import annotations

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from agent.mqtt.messages import TopicCache, correlation_properties, topic_field


def test_correlation_properties_carry_the_correlation_data_as_paho_packs_it():
    ours = correlation_properties(b"\x00\x01corr")
    theirs = Properties(PacketTypes.PUBLISH)
    theirs.CorrelationData = b"\x00\x01corr"
    assert ours.CorrelationData == b"\x00\x01corr"
    assert ours.pack() == theirs.pack()
    assert correlation_properties(b"a") is not correlation_properties(b"a")  # never shared


def test_topic_field_is_length_prefixed_utf8_and_refuses_what_paho_refuses():
    assert topic_field("edge/é") == b"\x00\x07edge/\xc3\xa9"
    for bad in ("", "a/+/b", "a/#", "x" * 65536):
        with pytest.raises(ValueError):
            topic_field(bad)
    cache = TopicCache()
    for n in range(TopicCache.LIMIT + 5):
        cache[f"t/{n}"] = topic_field(f"t/{n}")
    assert len(cache) <= TopicCache.LIMIT
