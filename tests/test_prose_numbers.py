"""Every measured number a chapter's "Predicted vs measured" section quotes is printed by its notebook.

The section is where a chapter reports what its notebook measured; a number there that no cell prints
is a number nobody can check (or one left behind when the notebook was run again). Numbers are those
with a decimal point or a thousands separator, outside code; a number the prose derives from printed
ones (a ratio of two of them, a formula's value) is listed in DERIVED with where it comes from."""
import json
import re

import pytest

from minitorch_dist.course.registry import CHAPTERS

pytestmark = pytest.mark.ch00

NUMBER = re.compile(r"(?<![\w.])(\d{1,3}(?:,\d{3})+|\d+\.\d+)(?![\w])")

#: chapter tag -> {number: where it comes from}: computed in the prose from printed numbers or formulas
DERIVED: dict[str, dict[str, str]] = {
    "ch02": {"0.010": "1 - exp(-omega^2/d) at omega = 10, d = 10,000 (the collision chance, in words)",
             "1.6": "the sparse lock-free throughput at 2 processes over 1, both printed",
             "1.9": "the dense lock-free throughput at 2 processes over 1, both printed"},
    "ch07": {"1,280": "the saved bytes of every-block checkpointing (printed) minus n·b + L"},
    "ch09": {"12.5": "the 50x smaller payload over the all-gather's n/2 = 4"},
    "ch13": {"7.2": "the 7,209,216 parameters the notebook prints, in millions"},
}
#: chapter tag -> the other chapter whose notebook the section may quote ("chapter 12's notebook measured")
CITES = {"ch14": "ch12"}


def _section(text: str) -> str:
    m = re.search(r"^## Predicted vs measured.*?(?=^## )", text, re.M | re.S)
    if m is None:
        return ""
    return re.sub(r"`[^`\n]*`", "", re.sub(r"^```.*?^```", "", m.group(0), flags=re.M | re.S))


def _printed(notebook) -> str:
    out = []
    for cell in json.loads(notebook.read_text())["cells"]:
        for o in cell.get("outputs", []):
            text = o.get("text") or o.get("data", {}).get("text/plain", "")
            out.append("".join(text) if isinstance(text, list) else text)
        if cell["cell_type"] == "markdown":
            out.append("".join(cell["source"]))
    return "\n".join(out)


@pytest.mark.parametrize("ch", [c for c in CHAPTERS if c.prose.exists() and c.notebook.exists()],
                         ids=lambda c: c.tag)
def test_the_measured_numbers_are_printed_by_the_notebook(ch):
    printed = _printed(ch.notebook)
    if ch.tag in CITES:
        printed += _printed(next(c for c in CHAPTERS if c.tag == CITES[ch.tag]).notebook)
    derived = DERIVED.get(ch.tag, {})
    missing = [n for n in NUMBER.findall(_section(ch.prose.read_text()))
               if n not in printed and n.replace(",", "") not in printed and n not in derived]
    assert missing == [], (f"{ch.rel(ch.prose)} quotes {missing} in 'Predicted vs measured', printed by no "
                           f"cell of {ch.rel(ch.notebook)}: run the notebook and quote what it prints")
