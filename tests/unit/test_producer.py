"""The demo producer's schedule: a steady rate (fractions carried on) and bursts."""

from __future__ import annotations

import pytest

from pacerd_demo.producer import ProducerParams, build_parser, jobs_for_second, params_from_args


def params(**overrides: object) -> ProducerParams:
    values: dict[str, object] = {
        "destinations": ("llm",), "rate": 2.5, "burst": 0, "burst_every_seconds": 300.0,
        "kind": "demo.call",
    }  # fmt: skip
    values.update(overrides)
    return ProducerParams(**values)  # type: ignore[arg-type]


def test_a_fractional_rate_is_carried_between_seconds() -> None:
    p, carry, live = params(), 0.0, []
    for second in range(1, 11):
        count, burst, carry = jobs_for_second(p, second, carry)
        live.append(count)
        assert burst == 0
    assert live == [2, 3] * 5  # 25 jobs in 10 s


def test_bursts_come_every_burst_every_seconds() -> None:
    p = params(rate=0.0, burst=100, burst_every_seconds=3.0)
    bursts = [jobs_for_second(p, second, 0.0)[1] for second in range(7)]
    assert bursts == [100, 0, 0, 100, 0, 0, 100]


def test_the_command_line_of_the_compose_producer() -> None:
    args = build_parser().parse_args(
        ["--destination=llm", "--destination=sms", "--rate=40", "--burst=3000", "--burst-every=300"]
    )
    assert params_from_args(args) == params(
        destinations=("llm", "sms"), rate=40.0, burst=3000, burst_every_seconds=300.0
    )


@pytest.mark.parametrize(
    "overrides", [{"destinations": ()}, {"rate": -1.0}, {"burst_every_seconds": 0.0}]
)
def test_invalid_parameters_are_refused(overrides: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="--"):
        params(**overrides)
