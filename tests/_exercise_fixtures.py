"""What the exercise tests share, the visible ones (tests/exercises/) and an instructor's held-out ones
(tests/exercises_hidden/, left out of a student's copy): the chapter under test (``ex``), and one launch
of ranks per world size. Each folder's conftest.py hands these fixtures to its tests.

``ex`` is the chapter's stubs or its worked solutions, the chapter read from the test file's name
(``test_ch03_pipeline.py`` tests ``ch03``): the stubs in ``exercises/`` once you have filled them in
(or in a student's copy of the course), the worked solutions while the stubs are untouched;
``MTD_IMPL=exercises|solutions`` forces one (``python -m minitorch_dist grade`` runs the stubs);
``MTD_MUTANT=path`` loads the solutions with that mutant run after them (``make check-exercises``).

``launches(fn, *args)`` (a fixture handing out :class:`Launches`) runs ``fn(*args)`` on n ranks the
first time a test asks for n ranks, and hands every later test of the module the same results. A
launch that raised (a stub's ``NotImplementedError`` on a rank, a hang) fails each test that reads
it with the ranks' error, rather than launching again for every test.
"""
from __future__ import annotations

import re

import pytest

from minitorch_dist.course.exercises import load
from minitorch_dist.runtime.launch import launch

from _support import case

_TEST_FILE = re.compile(r"test_(ch\d\d)_\w+\.py")


@pytest.fixture(scope="module")
def ex(request):
    """The chapter's stubs or its worked solutions (see the module docstring)."""
    m = _TEST_FILE.fullmatch(request.path.name)
    if m is None:
        raise ValueError(f"{request.path.name}: an exercise test file is named test_chNN_<name>.py, "
                         f"NN the chapter it tests")
    return load(m.group(1))


class Launches:
    """``fn(*args)`` on ranks, launched once per world size when first asked for (``kw``: launch's
    keywords, e.g. ``timeout_s``). ``self(n)``: the per-rank results on n ranks; ``self.case(n, name)``:
    each rank's value of case ``name`` where ``fn`` runs its cases through ``_support.run_cases``
    (a case that raised fails only the tests that read it)."""

    def __init__(self, fn, *args, **kw):
        self.fn, self.args, self.kw = fn, args, kw
        self._runs: dict[int, object] = {}

    def __call__(self, n: int) -> list:
        if n not in self._runs:
            try:
                self._runs[n] = launch(self.fn, n, *self.args, **self.kw)
            except Exception as e:  # handed to every test that reads this launch
                self._runs[n] = e
        got = self._runs[n]
        if isinstance(got, Exception):
            pytest.fail(f"the {n} ranks failed: {type(got).__name__}: {got}")
        return got

    def case(self, n: int, name) -> list:
        return [case(res, name, r) for r, res in enumerate(self(n))]


@pytest.fixture(scope="session")
def launches():
    """:class:`Launches`, for a module fixture to build its launch: ``launches(fn, *args, timeout_s=60)``."""
    return Launches
