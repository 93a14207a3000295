"""Chapter 00 — the grader's pytest plugin: a line per test event, written the moment it happens.

The grader runs each chapter's tests with this file copied into the run folder as a plain module,
``-p mtd_grade_plugin`` (so it imports nothing of the tree under test, which may hold a copy of
this package of its own) and ``MTD_GRADE_LOG=<a file>``. The JUnit report is written only when
pytest ends on its own; this log survives a test that never returns (the grader kills it at
``--timeout``) or one that ends pytest itself (``os._exit``, a crash), so the grader can still say
which test was running and how the earlier ones did. Each line is a JSON object, written with one
unbuffered ``write``:

    {"collected": ["test_a", "test_b[2]"]}           the tests pytest is about to run
    {"start": "test_a"}                              a test begins (its setup)
    {"report": "test_a", "outcome": "failed", "when": "call", "message": "...", "text": "..."}
    {"end": "test_a"}                                a test is over (its teardown done)

Without ``MTD_GRADE_LOG`` the plugin does nothing.
"""
from __future__ import annotations

import json
import os

LOG_ENV = "MTD_GRADE_LOG"
PLUGIN = "mtd_grade_plugin"  # the name the grader gives its copy of this module


def junit_name(nodeid: str) -> str:
    """The name the JUnit report gives a test: ``path::Class::test_x[2]`` -> ``test_x[2]``."""
    return nodeid.rsplit("::", 1)[-1]


def _write(event: dict) -> None:
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (json.dumps(event) + "\n").encode())
    finally:
        os.close(fd)


def pytest_collection_finish(session) -> None:
    _write({"collected": [junit_name(item.nodeid) for item in session.items]})


def pytest_runtest_logstart(nodeid, location) -> None:
    _write({"start": junit_name(nodeid)})


def pytest_runtest_logreport(report) -> None:
    if report.passed and report.when != "call":
        return
    crash = getattr(report.longrepr, "reprcrash", None)
    if report.skipped and isinstance(report.longrepr, tuple):  # (path, line, "Skipped: why")
        message = str(report.longrepr[2]).removeprefix("Skipped: ")
    else:
        message = crash.message if crash is not None else str(report.longrepr or "").strip()
    _write({"report": junit_name(report.nodeid), "outcome": report.outcome, "when": report.when,
            "message": message, "text": report.longreprtext[-4000:] if report.failed else ""})


def pytest_runtest_logfinish(nodeid, location) -> None:
    _write({"end": junit_name(nodeid)})
