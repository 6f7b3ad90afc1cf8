"""A published message's content frames, marshalled without pamqp's generic
walk over every property (most of ``write_batch``'s own CPU per message).

The properties pacerd's messages carry — ``content_type``, ``headers`` of
string values, ``delivery_mode``, ``correlation_id``, ``message_id`` — are
encoded here directly, byte for byte what pamqp writes (held to it by
``tests/unit/test_frames.py``); a message with any other property set, or a
value this path does not encode, goes through pamqp.
"""

from __future__ import annotations

import operator
import struct
from typing import TYPE_CHECKING, Any

from pamqp.encode import encode_table_value, field_table
from pamqp.frame import marshal
from pamqp.header import ContentHeader

if TYPE_CHECKING:
    from collections.abc import Callable

FRAME_HEADER, FRAME_BODY, FRAME_END = 2, 3, b"\xce"
BASIC_CLASS = 60
_FRAME = struct.Struct(">BHI")  # type, channel, payload size
_HEADER = struct.Struct(">BHIHHQH")  # the frame's, then class, weight, body size, flags
_LONG = struct.Struct(">I")
_OTHERS = (
    "content_encoding", "priority", "reply_to", "expiration", "timestamp", "message_type",
    "user_id", "app_id", "cluster_id",
)  # fmt: skip


_others = operator.attrgetter(*_OTHERS)
_UNSET = frozenset((None, ""))  # what pamqp does not write


class _Unusual(Exception):
    """A property this path does not encode: pamqp's turn."""


def _set(value: object) -> bool:
    return value is not None and value != ""  # as pamqp decides what to write


def _short(value: object) -> bytes:
    if not isinstance(value, str):
        raise _Unusual
    data = value.encode()
    if len(data) > 255:
        raise _Unusual
    return bytes((len(data),)) + data


def _table(headers: Any) -> bytes:
    if not headers or not isinstance(headers, dict):
        return field_table(headers)
    parts = []
    for key, value in sorted(headers.items()):
        name = _short(key)
        if len(name) > 129:  # a name pamqp truncates to 128 bytes
            raise _Unusual
        parts.append(name)
        if isinstance(value, str):
            data = value.encode()
            parts.append(b"S" + _LONG.pack(len(data)) + data)
        else:
            parts.append(encode_table_value(value))
    data = b"".join(parts)
    return _LONG.pack(len(data)) + data


def _octet_delivery_mode(value: Any) -> bytes:
    if value not in (1, 2):
        raise _Unusual  # pamqp says why
    return bytes((value,))


# the properties written here, in pamqp's order, with their flags
_DIRECT: tuple[tuple[str, int, Callable[[Any], bytes]], ...] = (
    ("content_type", 0x8000, _short),
    ("headers", 0x2000, _table),
    ("delivery_mode", 0x1000, _octet_delivery_mode),
    ("correlation_id", 0x0400, _short),
    ("message_id", 0x0080, _short),
)


def content_header(properties: Any, body_size: int, channel: int) -> bytes:
    """The content header frame of a message of ``body_size`` bytes."""
    try:
        if not _UNSET.issuperset(_others(properties)):
            raise _Unusual
        flags, parts = 0, []
        for name, flag, encode in _DIRECT:
            if _set(value := getattr(properties, name)):
                flags |= flag
                parts.append(encode(value))
    except (_Unusual, TypeError, AttributeError):
        return marshal(ContentHeader(properties=properties, body_size=body_size), channel)
    values = b"".join(parts)
    return (
        _HEADER.pack(FRAME_HEADER, channel, 14 + len(values), BASIC_CLASS, 0, body_size, flags)
        + values
        + FRAME_END
    )


def content_bodies(body: bytes, channel: int, max_size: int) -> list[bytes]:
    """The body frames of ``body``, each at most ``max_size`` bytes of it (none when empty)."""
    return [
        _FRAME.pack(FRAME_BODY, channel, len(chunk)) + chunk + FRAME_END
        for chunk in (body[i : i + max_size] for i in range(0, len(body), max_size))
    ]
