"""The passes of ``make test`` lose no test: a test marked ``serial`` by hand lives in a file the serial
or the deadlines pass runs (the main pass leaves every ``serial`` test out), no file is in both, and
every file a pass names exists."""
import re
from pathlib import Path

from _passes import (
    DEADLINE_FILES,
    DEADLINE_TESTS_IN,
    NUMERICS_FILES,
    PASSES,
    SERIAL_FILES,
    TIMED_TESTS_IN,
    WORLD_PARAM,
)

HERE = Path(__file__).parent


def test_every_hand_marked_serial_test_is_in_a_file_the_serial_pass_runs():
    mark = re.compile(r"^@pytest\.mark\.serial", re.M)
    marked = {p.name for p in HERE.rglob("test_*.py") if mark.search(p.read_text())}
    assert marked, "the scan finds the marks"
    late = PASSES["serial"] | PASSES["deadlines"]
    assert marked <= late, f"add {sorted(marked - late)} to TIMED_TESTS_IN or DEADLINE_TESTS_IN"


def test_every_file_a_pass_names_exists():
    names = {p.name for p in HERE.glob("test_*.py")}
    assert SERIAL_FILES | DEADLINE_FILES | TIMED_TESTS_IN | DEADLINE_TESTS_IN | NUMERICS_FILES <= names


def test_a_file_is_in_one_late_pass():
    assert not PASSES["serial"] & PASSES["deadlines"], "a file's serial tests run in one pass, not two"


def test_the_world_size_parameter_is_one_each_file_parametrizes():
    """A renamed parameter would silently put the 4-rank runs back into the portability pass (or, named
    after another parameter, leave out the wrong tests)."""
    assert set(WORLD_PARAM) <= NUMERICS_FILES
    for name, param in WORLD_PARAM.items():
        text = (HERE / name).read_text()
        assert re.search(rf'parametrize\("{param}"', text), f"{name} parametrizes no {param!r}"
