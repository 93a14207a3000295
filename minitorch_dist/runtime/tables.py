"""Chapter 00 — plain-text tables: the one formatter every table of the course prints through.

The tour, the grader, the planner and the CLI all print fixed-width tables; they share this one
function so their columns line up the same way everywhere.
"""
from __future__ import annotations

__all__ = ["format_table"]


def format_table(rows: list[list], header: list[str], align: str | None = None) -> str:
    """Plain-text table: a header, a rule of dashes, then one line per row; columns padded to fit.

    ``align``: one letter per column, ``"l"`` (left) or ``"r"`` (right: numbers, whose decimal points
    then line up when they show the same number of decimals), header included; None: all left.

    >>> print(format_table([["ddp", 2]], ["technique", "ranks"]))
    technique  ranks
    ---------  -----
    ddp        2
    >>> print(format_table([["ddp", "1.50"], ["zero-3", "12.25"]], ["technique", "GiB"], align="lr"))
    technique    GiB
    ---------  -----
    ddp         1.50
    zero-3     12.25
    """
    align = "l" * len(header) if align is None else align
    if len(align) != len(header) or set(align) - {"l", "r"}:
        raise ValueError(f"align must be one 'l' or 'r' per column ({len(header)} columns), got {align!r}")
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    pad = {"l": str.ljust, "r": str.rjust}
    lines = ["  ".join(pad[a](c, w) for c, w, a in zip(r, widths, align)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
