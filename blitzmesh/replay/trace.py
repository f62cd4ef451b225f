"""Reading the Azure LLM inference traces (`TIMESTAMP,ContextTokens,GeneratedTokens`).

Timestamps carry seven fractional digits (100 ns), more than `datetime` parses, so they are
split by hand; times come back in seconds since the first row.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

__all__ = ["REPO_ROOT", "TraceRow", "parse_timestamp", "parse_timestamp_ns", "read_azure_trace", "repo_relative"]

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
REPO_ROOT = Path(__file__).resolve().parents[2]


def repo_relative(path: Path) -> str:
    """How a result file names `path`: relative to the repository when it is inside it (the
    shipped traces, `bench/results/...`), so a committed result names no machine's own folders."""
    resolved = path.resolve()
    return str(resolved.relative_to(REPO_ROOT)) if resolved.is_relative_to(REPO_ROOT) else str(path)


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One request of a trace: when (seconds after the first row) and how many tokens."""

    t_s: float
    prompt_tokens: int
    output_tokens: int


def parse_timestamp_ns(text: str) -> int:
    """`YYYY-MM-DD HH:MM:SS[.fffffff]` (UTC) to POSIX nanoseconds, keeping every fractional digit
    (a float of POSIX seconds would round them to about 0.2 us)."""
    whole, _, frac = text.strip().partition(".")
    try:
        base = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC)
    except ValueError as e:
        raise ValueError(f"timestamp {text!r} is not 'YYYY-MM-DD HH:MM:SS[.fraction]'") from e
    if frac and not (frac.isdigit() and len(frac) <= 9):
        raise ValueError(f"timestamp {text!r} has a bad fraction {frac!r} (up to 9 digits)")
    return int(base.timestamp()) * 1_000_000_000 + (int(frac.ljust(9, "0")) if frac else 0)


def parse_timestamp(text: str) -> float:
    """`YYYY-MM-DD HH:MM:SS[.fffffff]` (UTC) to POSIX seconds."""
    return parse_timestamp_ns(text) / 1e9


def read_azure_trace(path: Path | str) -> list[TraceRow]:
    """Every row of the trace, in time order, with t_s relative to the earliest request."""
    path = Path(path)
    raw: list[tuple[int, int, int]] = []
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = set(COLUMNS) - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"trace {str(path)!r} lacks columns {sorted(missing)}; has {reader.fieldnames!r}")
        for line, row in enumerate(reader, start=2):
            try:
                prompt, output = int(row["ContextTokens"]), int(row["GeneratedTokens"])
                raw.append((parse_timestamp_ns(row["TIMESTAMP"]), prompt, output))
            except (TypeError, ValueError) as e:
                raise ValueError(f"trace {str(path)!r} line {line}: {e}") from e
            if prompt < 0 or output < 0:
                raise ValueError(f"trace {str(path)!r} line {line}: negative token count in {row!r}")
    if not raw:
        raise ValueError(f"trace {str(path)!r} has no rows")
    raw.sort(key=lambda r: r[0])
    t0 = raw[0][0]
    return [TraceRow((t - t0) / 1e9, p, o) for t, p, o in raw]
