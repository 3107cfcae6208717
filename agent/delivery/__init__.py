"""What happens to a message between the reply stream and the connection.

Owns: the outbox (the bounded queue the connection takes from), the on-disk spool (QoS 1/2
messages until acknowledged, requests until answered, the resend window), the one spool
writer thread, and application-level resend.

Modules: `outbox` (and `out_message`, the `OutMessage` it queues), `spool` (the `Spool`),
`spool_history` (acknowledged messages kept for resend), `spool_items` (what a write batch
holds, what is read back, the fsync rule), `spool_sql` (schema and statements), `spool_open`
(the check on open, a corrupt file moved aside), `spool_writer`, `resend`.

May import: `agent.protocol`, `agent.config`. Never paho (the connection is `agent.mqtt`),
never inference or models.
"""
