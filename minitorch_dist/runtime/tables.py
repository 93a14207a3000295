"""Chapter 00 — plain-text tables: the one formatter every table of the course prints through.

The tour, the grader, the planner and the CLI all print fixed-width tables; they share this one
function so their columns line up the same way everywhere.
"""
from __future__ import annotations

__all__ = ["format_table"]


def format_table(rows: list[list], header: list[str]) -> str:
    """Plain-text table: a header, a rule of dashes, then one line per row; columns padded to fit.

    >>> print(format_table([["ddp", 2]], ["technique", "ranks"]))
    technique  ranks
    ---------  -----
    ddp        2
    """
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
