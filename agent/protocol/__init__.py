"""The wire format of the contract, as pure functions: no threads, no sockets, no models.

Owns: the hostile-payload guard (size, zstd, a header walk before any CBOR object is built),
RFC 8746 tensors, request parsing and input checks, reply envelopes and parts, and the
layouts of repeated requests. One module each, imported in this order (none imports a later
one):

- `errors`: `WireError` and the contract's error codes, `Limits`, the id pattern and the
  protocol's constants, the helpers that keep messages one bounded line;
- `images`: JPEG/PNG byte-string inputs, their header read and bounded before decoding;
- `tensors`: RFC 8746 tensors to and from CBOR tags, and the hand-built CBOR of reply outputs
  (`outputs_pieces`, `encode_outputs`, `cbor_uint`, `cbor_text`: the reply hot path);
- `values`: every other ONNX value (string tensors, `seq`, `map`) to and from CBOR, the
  slow path `tensors` hands such values to (by a late import: values imports tensors);
- `cbor_scan`: the header-only walk of a CBOR map that bounds it before cbor2 decodes it;
- `payload`: the guard in its order (`decode_payload`) and `encode_payload`;
- `topics`: the one check of topics named from outside (`topic_problem`) and where replies
  may go (`ReplyTopics`);
- `requests`: `Request`, `parse_request` (the request table), `validate_inputs`;
- `replies`: reply envelopes, the `gone` message, parts split and reassembled;
- `layouts`: requests that repeat a recent request's layout, parsed without decoding.

May import: the standard library, numpy, cbor2, zstandard, and the tensor types of
`agent.models.backends.base`. Nothing else of the agent.
"""
