"""The wire format of the contract, as pure functions: no threads, no sockets, no models.

Owns: the hostile-payload guard (size, zstd, a header walk before any CBOR object is built),
RFC 8746 tensors, request parsing and input checks, reply envelopes and parts, and the
layouts of repeated requests.

May import: the standard library, numpy, cbor2, zstandard, and the tensor types of
`agent.models.backends.base`. Nothing else of the agent.
"""
