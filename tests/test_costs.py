"""ssr/costs.py: the cost table (interpolation, validation, persistence)."""

from __future__ import annotations

import json

import pytest

from ssr.costs import CostTable

TABLE = CostTable(rows=(1, 2, 3), widths=(1, 2, 4), cost=((1.0, 1.2, 1.6), (1.5, 1.9, 2.7), (2.0, 2.6, 3.8)),
                  base_seconds=0.08, meta={"kind": "test"})


def test_table_points_and_interpolation():
    assert TABLE(1, 1) == 1.0 and TABLE(2, 4) == 2.7
    assert TABLE(1, 3) == pytest.approx(1.4)  # halfway between widths 2 and 4
    assert TABLE(2, 3) == pytest.approx(2.3)
    assert TABLE(1, 8) == pytest.approx(1.6 + 0.2 * 4)  # beyond the last width: the last slope
    assert TABLE(4, 1) == pytest.approx(2.5)  # beyond the last row count
    assert TABLE(4, 8) == pytest.approx(TABLE(3, 8) + (TABLE(3, 8) - TABLE(2, 8)))
    assert CostTable.flat()(3, 16) == 1.0
    assert CostTable.linear()(3, 4) == pytest.approx(12.0)


@pytest.mark.parametrize("rows, widths, cost", [
    ((2, 3), (1, 2), ((1, 1), (1, 1))),  # must start at 1
    ((1, 1), (1, 2), ((1, 1), (1, 1))),  # strictly ascending
    ((1, 2), (1, 2), ((1, 1),)),  # shape
    ((1, 2), (1, 2), ((1, 1), (1,))),
    ((), (1,), ()),
])
def test_table_validation(rows, widths, cost):
    with pytest.raises(ValueError):
        CostTable(rows=rows, widths=widths, cost=cost)


def test_price_sums_passes_by_shape():
    assert TABLE.price({"1x1": 10, "2x4": 2, "1x3": 1}) == pytest.approx(10 * 1.0 + 2 * 2.7 + 1.4)
    assert TABLE.price({}) == 0.0
    assert CostTable.linear().price({"1x1": 5, "2x3": 1}) == pytest.approx(5 + 6)


def test_table_round_trip():
    again = CostTable.from_dict(json.loads(json.dumps(TABLE.to_dict())))
    assert again == TABLE and again.meta == TABLE.meta and again.base_seconds == TABLE.base_seconds
