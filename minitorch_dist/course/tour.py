"""Chapter 00 — the tour: one headline experiment per written chapter, theory next to measurement, in
one table.

``python -m minitorch_dist tour [--smoke] [--chapters ch00,ch01]`` imports each chapter's
``headline`` function (``Chapter.headline = "package.module:function"``, one module per chapter
in :mod:`minitorch_dist.course.headlines`), calls
``headline(smoke=...)`` (it launches its own ranks) and collects its rows::

    {"chapter": "ch00", "experiment": "ring all-reduce wire bytes, 4 ranks",
     "theory": 1.5e6, "measured": 1.5e6, "ok": True}

A chapter that raises gets a row with ``ok=False`` and the error's first line; the others still
run. The table is printed under the hardware it ran on.

**Exactness decides; timing informs.** Most rows check something exact -- equal to one process,
bytes, counts, memory -- and the exit status is 0 when every one of them agrees. A *timing* row
(``"timing": True``: a step time predicted, then measured) shows its ratio and, in its ``note``, how
much slower the machine was when it measured than when it calibrated. Its band is reported, never
enforced: on a laptop busy with other work a ratio outside it says so ("machine 2.4x slower than at
calibration"), and the tour still passes when every exactness row agrees.
"""
from __future__ import annotations

import importlib
import os
import sys
import time
from collections.abc import Callable, Sequence

from ..runtime.tables import format_table
from . import registry
from .registry import Chapter

KEYS = ("chapter", "experiment", "theory", "measured", "ok")


def resolve(spec: str) -> Callable:
    """The function named by ``"package.module:function"``."""
    module, _, attr = spec.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _cell(value, width: int = 48) -> str:
    """A table cell: floats to 4 significant figures, long text cut."""
    if isinstance(value, bool):
        text = "yes" if value else "NO"
    elif isinstance(value, float):
        text = f"{value:.4g}"
    else:
        text = str(value)
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def _error_line(exc: BaseException) -> str:
    first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def run_chapter(ch: Chapter, smoke: bool) -> list[dict]:
    """Rows of one chapter's headline; never raises (an error becomes an ok=False row)."""
    start = time.perf_counter()
    try:
        out = resolve(ch.headline)(smoke=smoke)
        rows = [out] if isinstance(out, dict) else list(out)
        if not rows:
            raise ValueError(f"{ch.headline} returned no rows")
        for row in rows:
            if not isinstance(row, dict) or (missing := [k for k in KEYS if k not in row]):
                raise ValueError(f"{ch.headline} returned a row without keys "
                                 f"{missing if isinstance(row, dict) else list(KEYS)}: {row!r}")
    except Exception as e:  # one broken chapter must not hide the others
        rows = [{"chapter": ch.tag, "experiment": _error_line(e), "theory": "", "measured": "", "ok": False,
                 "error": _error_line(e)}]
    seconds = time.perf_counter() - start
    # the chapter's wall time goes on its first row: its rows came from one run
    return [dict(row, ok=bool(row["ok"]), seconds=seconds if i == 0 else None) for i, row in enumerate(rows)]


def hardware() -> str:
    try:
        from ..runtime.env import hardware_summary

        return hardware_summary()
    except Exception as e:  # the table is still worth printing
        return f"hardware summary unavailable ({_error_line(e)})"


def _ok_cell(row: dict) -> str:
    """"yes" / "NO" for an exactness row; a timing row's band: "yes" / "off" (reported, not enforced)."""
    if row.get("timing"):
        return "yes" if row["ok"] else "off"
    return _cell(row["ok"])


def results_table(rows: list[dict]) -> str:
    body = [[_cell(r["chapter"], 8), _cell(r["experiment"]), _cell(r["theory"], 24), _cell(r["measured"], 24),
             _ok_cell(r), "" if r.get("seconds") is None else f"{r['seconds']:.1f}",
             _cell(r.get("note", ""), 64)] for r in rows]
    return format_table(body, ["chapter", "experiment", "theory", "measured", "ok", "s", "note"])


def exit_status(rows: list[dict]) -> int:
    """0 when every exactness row agrees (timing rows are reported, not enforced), else 1."""
    return 0 if all(r["ok"] for r in rows if not r.get("timing")) else 1


def run(chapters: Sequence[Chapter] | None = None, smoke: bool = False, progress: bool = True) -> int:
    """Run the tour over `chapters` (default: written ones with a headline); print; return the exit code."""
    chosen = registry.written_chapters() if chapters is None else chapters
    chapters = [ch for ch in chosen if ch.headline]
    if not chapters:
        what = ("No chapter is written yet" if not registry.written_chapters()
                else "No chosen chapter has a headline")
        print(f"{what}: the tour has nothing to run. The planned chapters:\n")
        print(registry.planned_table())
        return 0
    if smoke:
        os.environ["MTD_SMOKE"] = "1"  # ranks the headlines launch inherit it
    from tqdm.auto import tqdm

    rows: list[dict] = []
    bar = tqdm(chapters, desc="tour", unit="chapter", file=sys.stderr, disable=not progress)
    for ch in bar:
        bar.set_postfix_str(ch.tag)
        rows += run_chapter(ch, smoke)
    bar.close()
    print(hardware())
    print(f"sizes: {'smoke (MTD_SMOKE=1)' if smoke else 'default'}\n")
    print(results_table(rows))
    print()
    for r in rows:
        if "error" in r:
            print(f"{r['chapter']}: {r['error']}")
    exact = [r for r in rows if not r.get("timing")]
    timing = [r for r in rows if r.get("timing")]
    bad = sum(not r["ok"] for r in exact)
    print(f"{len(exact) - bad}/{len(exact)} exact experiments agree with theory"
          + (f"; {bad} did not" if bad else ""))
    if timing:
        off = sum(not r["ok"] for r in timing)
        print(f"{len(timing) - off}/{len(timing)} step times within their band of the prediction"
              + (f"; {off} outside (a timing row reports the machine it ran on; it never fails the tour)"
                 if off else ""))
    return exit_status(rows)


def add_arguments(p) -> None:
    p.add_argument("--smoke", action="store_true",
                   help="small sizes (sets MTD_SMOKE=1): seconds, not minutes")
    p.add_argument("--chapters",
                   help="comma-separated chapters to run (ch00,ch01); default: every written one")


def main(args) -> int:
    from ..runtime.env import smoke as env_smoke

    chapters = None
    if args.chapters:
        try:
            chosen = [registry.chapter(k) for k in args.chapters.split(",") if k.strip()]
        except KeyError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        for ch in chosen:
            if not (ch.written and ch.headline):
                why = "no headline experiment" if ch.written else "not written yet"
                print(f"skipping {ch.tag}: {why}", file=sys.stderr)
        chapters = [ch for ch in chosen if ch.written]
    return run(chapters, smoke=args.smoke or env_smoke())
