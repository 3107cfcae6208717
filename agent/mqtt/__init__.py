"""The MQTT connection: the only package that knows paho.

Owns: connecting, the will and birth messages, reconnects with jitter, the epoch, reading
requests off the socket and publishing what the outbox holds within the broker's limits.

* `connection`: `Transport`, the io thread and lock, connect/reconnect, keepalive;
* `socket_wait`: what the io thread waits on (the socket, a wake-up);
* `window`: the in-flight window, publishing the outbox, settling acknowledgements;
* `inbound`: received messages to the handler, acknowledged at once or deferred;
* `messages`: `Incoming`, `RequestProperties`, `parse_publish`, `correlation_properties`;
* `epoch`: `EpochStore`; `reconnect`: backoff, password, TLS, a new client's settings;
* `poison`: the quarantine of messages never to be published again (a topic the broker
  refuses, a permanent refusal, a suspect of lost connections, published alone);
* `paho_fast`: the fast client and `new_client`, the only module using paho's private
  names, checked at import against the paho versions it was written for (2.1, 2.2);
  `paho_plain`: paho's own client behind the same interface, the fallback.

May import: paho, `agent.config`, `agent.delivery.outbox`, `agent.protocol.topics` (the one
topic check).
"""
