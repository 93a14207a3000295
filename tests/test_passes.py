"""The passes of ``make test`` lose no test: a test marked ``serial`` by hand lives in a file the serial
pass runs (the main pass leaves every ``serial`` test out), and every file a pass names exists."""
import re
from pathlib import Path

from _passes import NUMERICS_FILES, PASSES, SERIAL_FILES, TIMED_TESTS_IN

HERE = Path(__file__).parent


def test_every_hand_marked_serial_test_is_in_a_file_the_serial_pass_runs():
    mark = re.compile(r"^@pytest\.mark\.serial", re.M)
    marked = {p.name for p in HERE.rglob("test_*.py") if mark.search(p.read_text())}
    assert marked, "the scan finds the marks"
    assert marked <= PASSES["serial"], f"add {sorted(marked - PASSES['serial'])} to TIMED_TESTS_IN"


def test_every_file_a_pass_names_exists():
    names = {p.name for p in HERE.glob("test_*.py")}
    assert SERIAL_FILES | TIMED_TESTS_IN | NUMERICS_FILES <= names
