"""The measured cost of one backend step on the machine it runs on, as a function of lanes and tokens per lane.

An extra lane or an extra verified token is almost free on some machines and doubles the step on others (see
docs/design.md, the cost model), so the speculation policy prices its choices with this table, never with a constant.
The table is measured by ``ssr.calibrate`` (cached on disk per model, dtype, device, CPU and torch version); tests
inject one.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class CostTable:
    """``cost[i][j]``: seconds of one step with ``rows[i]`` lanes of ``widths[j]`` tokens each, divided by the
    seconds of one lane decoding one token (``base_seconds``). ``rows`` and ``widths`` ascend and start at 1."""

    rows: tuple[int, ...]
    widths: tuple[int, ...]
    cost: tuple[tuple[float, ...], ...]
    base_seconds: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not self.rows or not self.widths or self.rows[0] != 1 or self.widths[0] != 1:
            raise ValueError("CostTable: rows and widths must start at 1")
        if list(self.rows) != sorted(set(self.rows)) or list(self.widths) != sorted(set(self.widths)):
            raise ValueError("CostTable: rows and widths must be strictly ascending")
        if len(self.cost) != len(self.rows) or any(len(r) != len(self.widths) for r in self.cost):
            raise ValueError("CostTable: cost must be len(rows) x len(widths)")

    def __call__(self, rows: int, width: int) -> float:
        """Relative cost of a step with ``rows`` lanes fed ``width`` tokens each (linear between measured points,
        linear extrapolation from the last two beyond them)."""
        def along(axis: tuple[int, ...], x: int, value) -> float:
            if len(axis) == 1:
                return value(0) * (x / axis[0])
            i = min(max(bisect.bisect_right(axis, x) - 1, 0), len(axis) - 2)
            x0, x1 = axis[i], axis[i + 1]
            y0, y1 = value(i), value(i + 1)
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)

        return along(self.rows, rows, lambda i: along(self.widths, width, lambda j: self.cost[i][j]))

    def price(self, pass_shapes: dict[str, int]) -> float:
        """Steps (one-lane one-token steps of this table) that passes of these shapes cost: ``pass_shapes`` as a
        request's stats count them, ``"{lanes}x{tokens per lane}"`` -> passes."""
        total = 0.0
        for shape, passes in pass_shapes.items():
            rows, _, width = shape.partition("x")
            total += passes * self(int(rows), int(width))
        return total

    # -- tables for tests and for machines where nothing was measured ---------------------------------------------
    @classmethod
    def flat(cls) -> "CostTable":
        """Every step costs the same, whatever it holds (speculation always pays)."""
        return cls(rows=(1, 2), widths=(1, 2), cost=((1.0, 1.0), (1.0, 1.0)), meta={"kind": "flat"})

    @classmethod
    def linear(cls) -> "CostTable":
        """A step costs in proportion to the tokens it holds: every extra row or token is a whole extra step, so no
        speculation can pay and SSR must decode exactly as plain decoding does."""
        return cls(rows=(1, 2), widths=(1, 2), cost=((1.0, 2.0), (2.0, 4.0)), meta={"kind": "linear"})

    # -- persistence -------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"rows": list(self.rows), "widths": list(self.widths), "cost": [list(r) for r in self.cost],
                "base_seconds": self.base_seconds, "meta": dict(self.meta)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CostTable":
        return cls(rows=tuple(data["rows"]), widths=tuple(data["widths"]),
                   cost=tuple(tuple(float(c) for c in r) for r in data["cost"]),
                   base_seconds=float(data.get("base_seconds", 0.0)), meta=dict(data.get("meta", {})))
