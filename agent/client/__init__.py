"""The subscriber SDK: send a request to an agent and iterate its reply stream.

    with AgentClient("127.0.0.1", 1883, device_id="jetson-01") as client:
        for chunk in client.request("decoder", {"token": tokens}):
            print(chunk.index, chunk.outputs["next_token"])

The SDK does what every subscriber has to do, once: it subscribes to the reply topic before
publishing the request, decodes CBOR and RFC 8746 tensors, reassembles `part` messages, drops
duplicates by `seq` (QoS 1 delivers at least once), yields chunks in `seq` order, raises a
typed :class:`AgentError` for an `error` message and :class:`ReplyTimeout` when the stream
goes quiet.

Import from here (`from agent.client import AgentClient`); the modules are `connection`
(`AgentClient`: the broker connection, requests, routing) and `reply` (`Reply`: one reply
stream's ordering, reassembly, recovery and errors).

May import: paho, numpy, `agent.protocol`, the `Array` type (`agent.models.backends.base`).
Never the service: a subscriber runs on another machine.
"""

from agent.client.connection import AgentClient
from agent.client.reply import (
    REPLY_LIMITS,
    AgentError,
    Chunk,
    Reply,
    ReplyTimeout,
    StreamEnd,
    decode_outputs,
)

__all__ = [
    "REPLY_LIMITS",
    "AgentClient",
    "AgentError",
    "Chunk",
    "Reply",
    "ReplyTimeout",
    "StreamEnd",
    "decode_outputs",
]
