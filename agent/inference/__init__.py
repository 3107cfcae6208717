"""Running admitted requests: the queue, the workers, the one runner, the reply streams.

Owns: the bounded priority scheduler and its worker threads, dynamic batching, which
requests are short enough to run where they were read, the runner (one decode loop for every
mode, a single request being a batch of one), reply streams (numbering, parts, one terminal
message) and image/frame preprocessing.

May import: `agent.protocol`, `agent.delivery` (messages go to the outbox),
`agent.models` (sessions and leases). Never `agent.mqtt` or `agent.service`.
"""
