"""The header-only walk of one CBOR map: well-formedness and the limits on nesting, map sizes
and item counts, checked before cbor2 builds a single Python object, and the request ``id``
read on the way, so that even a request refused for its shape can be answered.

`agent.protocol.payload` runs it on every payload that is not decoded first (see there).
"""

from __future__ import annotations

from agent.protocol.errors import ID_PATTERN, WireError

__all__ = ["STRUCTURAL_TAGS", "scan_map"]

# Encoder-side deduplication (value sharing, string references): never used by this protocol,
# and the only tags that could turn a tree into a graph with cycles.
STRUCTURAL_TAGS = frozenset({25, 28, 29, 256})

_ARRAY, _MAP, _TAG, _BYTE_CHUNKS, _TEXT_CHUNKS = range(5)
_ID_KEY = b"id"


def scan_map(buf: memoryview, *, max_depth: int, max_map_keys: int, max_items: int) -> str | None:
    """Walk the item headers of one CBOR map without building anything; return its ``id``.

    cbor2 checks depth, but only bounds map sizes and item counts after it has built the
    objects; this walk reads only headers and skips string bodies in O(1), so its cost is the
    number of items, which it bounds. It also checks well-formedness (RFC 8949 §3, appendix C)
    and that nothing follows the map.

    On the way it remembers the top-level ``id`` when it is a valid id, so that a request
    refused later in the walk, or by cbor2, or by :func:`agent.protocol.requests.parse_request`,
    can still be answered.
    Raises :class:`WireError` (``bad_request``) carrying that id when it was seen first.
    """
    n = len(buf)
    if n == 0:
        raise WireError("bad_request", "the payload is empty")
    if buf[0] >> 5 != 5:
        raise WireError("bad_request", "the payload is not a CBOR map")
    pos = 0
    items = 0
    depth = 0  # open arrays, maps and tags
    # One entry per open container or indefinite-length string.
    kinds: list[int] = []
    left: list[int] = []  # items still expected; -1 for indefinite length
    seen: list[int] = []  # items read so far (a map counts keys and values)
    request_id: str | None = None
    id_next = False  # the top-level key just read was "id"

    def bad(message: str) -> WireError:
        return WireError("bad_request", message, request_id)

    while True:
        if pos >= n:
            raise bad("the CBOR ends in the middle of an item")
        initial = buf[pos]
        pos += 1
        major = initial >> 5
        info = initial & 0x1F

        if initial == 0xFF:  # "break": closes an indefinite-length item
            if not kinds or left[-1] != -1:
                raise bad("malformed CBOR: a break code outside an indefinite-length item")
            if kinds[-1] == _MAP and seen[-1] % 2:
                raise bad("malformed CBOR: a map ends after a key without its value")
            if kinds[-1] <= _TAG:
                depth -= 1
            kinds.pop()
            left.pop()
            seen.pop()
        else:
            items += 1  # chunks of indefinite-length strings count too: each costs a loop
            if items > max_items:
                raise bad(f"the payload holds more than {max_items} CBOR items")
            in_chunks = bool(kinds) and kinds[-1] >= _BYTE_CHUNKS
            if in_chunks:
                want = 2 if kinds[-1] == _BYTE_CHUNKS else 3
                if major != want or info == 31:
                    raise bad("malformed CBOR: a bad chunk in an indefinite-length string")
            elif depth > max_depth:
                raise bad(f"CBOR nesting deeper than {max_depth} levels")
            top_level = depth == 1 and kinds[0] == _MAP and not in_chunks
            if top_level and seen[0] % 2 == 0:
                id_next = False  # a new top-level key starts

            if info < 24:
                arg = info
            elif info < 28:
                size = 1 << (info - 24)
                if pos + size > n:
                    raise bad("the CBOR ends in the middle of an item")
                arg = int.from_bytes(buf[pos : pos + size], "big")
                pos += size
            elif info == 31 and 2 <= major <= 5:
                arg = -1
            else:
                raise bad(f"malformed CBOR: additional information {info} in major type {major}")

            if major == 2 or major == 3:
                if arg == -1:
                    kinds.append(_BYTE_CHUNKS if major == 2 else _TEXT_CHUNKS)
                    left.append(-1)
                    seen.append(0)
                    continue
                if arg > n - pos:
                    raise bad("the CBOR ends in the middle of a string")
                if top_level and major == 3:
                    if seen[0] % 2 == 0:
                        id_next = arg == 2 and buf[pos : pos + 2] == _ID_KEY
                    elif id_next and request_id is None and arg <= 64:
                        candidate = _ascii(buf[pos : pos + arg])
                        if candidate is not None and ID_PATTERN.match(candidate):
                            request_id = candidate
                pos += arg
            elif major == 4 or major == 5:
                if major == 5 and arg > max_map_keys:
                    raise bad(f"a map has {arg} keys, over the limit of {max_map_keys}")
                count = arg if major == 4 or arg == -1 else 2 * arg
                if count > n - pos:  # every item takes at least one byte
                    raise bad("the CBOR ends in the middle of a container")
                if count > max_items - items:
                    raise bad(f"the payload holds more than {max_items} CBOR items")
                if count:
                    kinds.append(_ARRAY if major == 4 else _MAP)
                    left.append(count)
                    seen.append(0)
                    depth += 1
                    continue
            elif major == 6:
                if arg in STRUCTURAL_TAGS:
                    raise bad(
                        f"CBOR tag {arg} (value sharing or string references) is not accepted"
                    )
                kinds.append(_TAG)
                left.append(1)
                seen.append(0)
                depth += 1
                continue
            elif major == 7 and info == 24 and arg < 32:
                raise bad("malformed CBOR: a simple value in two bytes below 32")
            # Major types 0, 1 and 7, definite strings and empty containers: item complete.

        # An item is complete: count it in its container, closing those it completes.
        while True:
            if not kinds:
                if pos != n:
                    raise bad(f"{n - pos} bytes follow the CBOR map")
                return request_id
            seen[-1] += 1
            if left[-1] == -1:
                if kinds[-1] == _MAP and seen[-1] > 2 * max_map_keys:
                    raise bad(f"a map has more than {max_map_keys} keys")
                break
            left[-1] -= 1
            if left[-1]:
                break
            if kinds[-1] <= _TAG:
                depth -= 1
            kinds.pop()
            left.pop()
            seen.pop()


def _ascii(data: memoryview) -> str | None:
    try:
        return bytes(data).decode("ascii")
    except UnicodeDecodeError:
        return None
