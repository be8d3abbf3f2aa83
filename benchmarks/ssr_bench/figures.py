"""What the reports share: the statistics they print (quantiles, means) and how they draw and save a figure."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterable


def quantile(values: Iterable[Any], q: float) -> float | None:
    """The q-quantile (linear interpolation) of the numbers in ``values``; None and NaN are left out."""
    vals = sorted(v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v)))
    if not vals:
        return None
    pos = (len(vals) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def mean(values: Iterable[Any]) -> float | None:
    vals = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return sum(vals) / len(vals) if vals else None


def geomean(values: Iterable[float]) -> float | None:
    vals = [v for v in values if isinstance(v, (int, float)) and v > 0]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None


def fmt(v: Any, digits: int = 2) -> str:
    """A table cell: '-' for a missing number, floats to ``digits`` places."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def pyplot():
    """matplotlib's pyplot on the file-only backend (benchmarks run without a screen)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path, dpi: int = 110) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path
