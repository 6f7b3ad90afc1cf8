"""pacerd.frames writes what pamqp writes: every content header and body
frame, byte for byte, whatever the properties (pamqp's path for the unusual ones)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import aiormq
from hypothesis import given, settings
from hypothesis import strategies as st
from pamqp.body import ContentBody
from pamqp.frame import marshal
from pamqp.header import ContentHeader

from pacerd.frames import content_bodies, content_header

short = st.text(max_size=90)
values = st.one_of(st.text(max_size=40), st.integers(-(2**31), 2**31 - 1), st.booleans(), st.none())
properties = st.fixed_dictionaries(
    {},
    optional={
        "content_type": st.sampled_from(["application/json", "", "text/plain"]),
        "headers": st.dictionaries(st.text(min_size=1, max_size=140), values, max_size=4),
        "delivery_mode": st.sampled_from([1, 2]),
        "correlation_id": short,
        "message_id": short,
        "priority": st.integers(0, 9),
        "app_id": short,
        "timestamp": st.datetimes(
            min_value=dt.datetime(2000, 1, 1), max_value=dt.datetime(2100, 1, 1)
        ),
    },
)


def pamqp_header(props: aiormq.spec.Basic.Properties, size: int, channel: int) -> bytes:
    return marshal(ContentHeader(properties=props, body_size=size), channel)


@settings(max_examples=400, deadline=None)
@given(properties, st.integers(0, 2**40), st.integers(1, 65535))
def test_the_content_header_is_pamqps(fields: dict[str, Any], size: int, channel: int) -> None:
    props = aiormq.spec.Basic.Properties(**fields)
    assert content_header(props, size, channel) == pamqp_header(props, size, channel)


def test_the_outcome_properties_take_the_direct_path() -> None:
    props = aiormq.spec.Basic.Properties(
        content_type="application/json", delivery_mode=2, message_id="j-1:3",
        correlation_id="j-1", headers={"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"},
    )  # fmt: skip
    assert content_header(props, 57, 2) == pamqp_header(props, 57, 2)
    empty = aiormq.spec.Basic.Properties(headers={})
    assert content_header(empty, 0, 1) == pamqp_header(empty, 0, 1)


@given(st.binary(max_size=300), st.integers(1, 120), st.integers(1, 65535))
def test_the_body_frames_are_pamqps(body: bytes, max_size: int, channel: int) -> None:
    expected = [
        marshal(ContentBody(body[i : i + max_size]), channel) for i in range(0, len(body), max_size)
    ]
    assert content_bodies(body, channel, max_size) == expected
