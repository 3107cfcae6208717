"""The broker's session as the agent sees it at every CONNACK, the subscriptions it then asks
for (and when the broker has them), and what a refused or closed connection attempt is told
as.

The agent asks for a session that outlives a connection (MQTT 5: Clean Start 0 and
`session_expiry_s`; 3.1.1: Clean Session 0), so that QoS 1/2 requests published while it is
away are kept for it by the broker. Whether the broker kept one is the CONNACK's Session
Present flag, read here at every connection (decision 0024):

* present: the QoS 2 flows the previous connection left unfinished are finished (PUBREL for
  their ids, `Client.release`). Otherwise they stay in the broker's session, each taking one
  of its quota of unreleased QoS 2 messages (Mosquitto: 20) until the session expires, and
  the broker drops publishes past the quota. The messages themselves are published again
  from the spool (decision 0004); a released one the broker held arrives twice, as any
  duplicate after a reconnect.
* absent where one was expected (every connection after the first of this process, while
  sessions outlive a connection): requests published while the agent was away are lost to
  it. Logged at WARNING, counted, and reported (`on_lost`: the agent's
  `broker_session_lost` event).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode
from paho.mqtt.subscribeoptions import SubscribeOptions

from agent.config import MqttConfig
from agent.mqtt.paho_plain import Client

log = logging.getLogger(__name__)

UNSUPPORTED_PROTOCOL = 0x84  # MQTT 5 CONNACK; paho maps a 3.1.1 return code 1 to it


class BrokerSession:
    """Reads the Session Present flag of every CONNACK (under the transport's io lock)."""

    def __init__(self, config: MqttConfig, on_lost: Callable[[], None]) -> None:
        """`on_lost()`: the broker had no session where one was expected; called under the
        io lock, so it may queue (never wait for) a message."""
        self.expected = config.protocol == "3.1.1" or config.session_expiry_s > 0
        self._on_lost = on_lost
        self._connected_before = False
        self.lost = 0  # connections on which the broker had lost the session

    def connected(self, client: Client, session_present: bool, unreleased: set[int]) -> None:
        """A CONNACK accepted the connection: finish the QoS 2 flows of a resumed session,
        or report a session the broker lost."""
        first, self._connected_before = not self._connected_before, True
        if session_present:
            if unreleased:
                log.info("mqtt: releasing %d unfinished QoS 2 publish(es)", len(unreleased))
                client.release(unreleased)
            return
        if first or not self.expected:
            return
        self.lost += 1
        log.warning(
            "mqtt: the broker kept no session for the agent: requests published while it was "
            "away may be lost (a broker restart without persistence, or an expired session)"
        )
        try:
            self._on_lost()
        except Exception:
            log.exception("mqtt: on_session_lost hook failed")


def refusal_text(reason: ReasonCode, mqtt5: bool) -> str:
    """What a CONNACK's refusal is told as: a protocol the broker does not speak says which
    setting to change."""
    if reason.value == UNSUPPORTED_PROTOCOL:
        if mqtt5:
            return (
                'the broker does not speak MQTT 5: set [mqtt] protocol = "3.1.1" '
                "(see docs/operations.md, Broker compatibility)"
            )
        return "the broker refused MQTT 3.1.1 (Unsupported protocol version)"
    return f"broker refused the connection: {reason}"


def closed_early_text(reason: ReasonCode, mqtt5: bool) -> str:
    """What a connection the broker closed before its CONNACK is told as."""
    causes = "a TLS client certificate it refused, a listener it was not allowed on"
    if mqtt5:
        causes += ', or a broker that does not speak MQTT 5 ([mqtt] protocol = "3.1.1")'
    return f"the broker closed the connection before accepting it ({causes}): {reason}"


def no_connack_text(timeout_s: float, mqtt5: bool) -> str:
    """What a connection left without a CONNACK is told as: amqtt, MQTT 3.1.1 only, reads an
    MQTT 5 CONNECT with a will as a truncated one and waits for the rest."""
    text = f"no CONNACK within {timeout_s:.0f} s"
    if mqtt5:
        text += ' (a broker that does not speak MQTT 5 may wait: try [mqtt] protocol = "3.1.1")'
    return text


def subscription_options(
    subscriptions: Sequence[tuple[str, int]], mqtt5: bool
) -> list[tuple[str, Any]]:
    """The subscriptions, all of them requests to the agent: on MQTT 5 the broker is asked
    never to send their retained messages (Retain Handling 2); on 3.1.1 it sends them, with
    the retain flag set, and the ingress ignores them."""
    if not mqtt5:
        return list(subscriptions)
    never = SubscribeOptions.RETAIN_DO_NOT_SEND
    return [
        (topic, SubscribeOptions(qos=qos, retainHandling=never)) for topic, qos in subscriptions
    ]


class Subscriptions:
    """The agent's subscriptions on each connection: asked for after every CONNACK, and
    `active` once the broker's SUBACK came back. A request published before then finds no
    subscription on a fresh session, and the broker drops it, so the agent is ready (the
    service's READY, `Agent.wait_ready`) only once they are active."""

    def __init__(self, subscriptions: Sequence[tuple[str, int]], mqtt5: bool) -> None:
        self._filters = list(subscriptions)
        self._mqtt5 = mqtt5
        self._mid: int | None = None
        self.active = threading.Event()
        if not self._filters:
            self.active.set()

    def subscribe(self, client: mqtt.Client) -> None:
        """After a CONNACK (under the io lock): ask for them again."""
        if not self._filters:
            return
        _, self._mid = client.subscribe(subscription_options(self._filters, self._mqtt5))

    def acknowledged(
        self,
        client: mqtt.Client,
        userdata: Any,
        mid: int,
        reasons: list[ReasonCode],
        properties: Properties,
    ) -> None:
        """paho's `on_subscribe`: the SUBACK of `subscribe`'s packet. A filter the broker
        refused (an ACL, say) is logged: requests on it will not arrive."""
        if mid != self._mid:
            return
        for (topic, _), reason in zip(self._filters, reasons, strict=False):
            if reason.is_failure:
                log.error("mqtt: the broker refused the subscription to %s: %s", topic, reason)
        self.active.set()

    def lost(self) -> None:
        """The connection ended: the next one subscribes again."""
        if self._filters:
            self.active.clear()
