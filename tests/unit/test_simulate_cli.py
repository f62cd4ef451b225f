"""`python -m bench.simulate --heteroscale KEY=JSON`: parameters of the scenario's HeteroScale
runs overridden from the command line, and bad pairs refused with the pair quoted."""

from __future__ import annotations

import pytest

from bench.simulate.scenarios import heteroscale_overrides as _overrides


def test_pairs_parse_as_json_values() -> None:
    assert _overrides(["queue_target_s=0.25", 'queue_rate="served"', "queue_min_tokens=0"]) == {
        "queue_target_s": 0.25,
        "queue_rate": "served",
        "queue_min_tokens": 0,
    }
    assert _overrides([]) == {}


@pytest.mark.parametrize(
    ("item", "match"),
    [
        ("queue_target_s", "KEY=JSON, got 'queue_target_s'"),
        ("queue_rate=served", "'queue_rate=served': the value is not JSON"),
    ],
)
def test_bad_pairs_are_refused_with_the_pair_quoted(item: str, match: str) -> None:
    with pytest.raises(SystemExit, match=match):
        _overrides([item])
