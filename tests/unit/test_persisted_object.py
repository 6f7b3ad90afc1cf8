"""A destination's persisted pacer state as a row carries it: the JSON text,
decoded when first read (every tick reads the row; few need the state)."""

from __future__ import annotations

import json

import pytest

from pacerd.ledger import PersistedObject

STATE = {"pacer": {"rate": 5.0, "ceiling": None}, "tick": {"budget": 3}}


def test_reads_as_the_object_it_was_saved_as() -> None:
    persisted = PersistedObject(json.dumps(STATE))
    assert persisted == STATE
    assert persisted["pacer"] == {"rate": 5.0, "ceiling": None}
    assert persisted.get("missing") is None
    assert {**persisted, "pacer": {"rate": 1.0}} == {"pacer": {"rate": 1.0}, "tick": {"budget": 3}}
    assert sorted(persisted) == ["pacer", "tick"]
    assert len(persisted) == 2


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '"a string"', "3", "null"])
def test_anything_but_an_object_reads_as_empty_and_never_raises(text: str) -> None:
    persisted = PersistedObject(text)  # nothing is decoded yet
    assert not persisted
    assert dict(persisted) == {}
    empty: dict[str, object] = {}
    assert (persisted or empty).get("pacer") is None
