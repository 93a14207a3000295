"""Chapter 00 — what a failed launch says: which rank is to blame, and how it failed.

When one rank of a job fails, its peers usually fail a moment later *because of it*: a rank blocked
in a collective whose partner vanished gets "Connection reset by peer" from gloo (NCCL: "remote
process exited"). Reporting the lowest failing rank would then often blame an innocent rank. So a
failure is one of:

- a **cause**: the rank raised an error of its own, or died without reporting (an exit code, or a
  signal such as SIGKILL or SIGABRT; its stderr tells why);
- a **consequence**: its error only says that a peer went away (:func:`is_peer_gone`).

:func:`blame` picks the culprit: the lowest rank whose failure is a cause (so the same report every
run), falling back to the lowest failing rank when every failure looks like a consequence.
"""
from __future__ import annotations

import os
import signal

# What gloo, NCCL and the TCP store say when the process at the other end went away.
PEER_GONE_PATTERNS = (
    "connection reset by peer",
    "connection closed by peer",
    "broken pipe",
    "connection refused",
    "connection was likely closed",
    "remote process exited",
    "communicator was aborted",
    "socket closed",
)


class RankError(RuntimeError):
    """A rank raised (or died). ``.rank`` names the culprit; ``.remote_traceback`` is its traceback
    (or, for a rank that died, its exit code or signal and the tail of its stderr).
    ``.consequences`` lists the ranks that failed only because a peer went away; ``.others`` the
    other ranks that failed on their own."""

    def __init__(self, rank: int, remote_traceback: str, world_size: int, *,
                 consequences: dict | None = None, others: tuple = ()):
        self.rank, self.remote_traceback, self.world_size = rank, remote_traceback, world_size
        self.consequences, self.others = dict(consequences or {}), tuple(others)
        lines = [f"rank {rank} of {world_size} failed:", "", remote_traceback.rstrip()]
        if self.others:
            lines += ["", f"(ranks {list(self.others)} failed too)"]
        for r, why in sorted(self.consequences.items()):
            lines += ["", f"(rank {r} then failed as a consequence, its peer having gone: {why})"]
        super().__init__("\n".join(lines))


class LaunchTimeout(RuntimeError):
    """Not every rank finished within ``timeout_s``. ``.last_ops[r]`` is what rank r was last doing."""

    def __init__(self, timeout_s: float, last_ops: dict, finished: set):
        self.last_ops, self.finished = last_ops, finished
        lines = [f"launch timed out after {timeout_s:g} s; every rank was killed. Last op of each rank:"]
        shown = [(r, "finished" if r in finished else op) for r, op in sorted(last_ops.items())]
        for first, last, op in _runs(shown):  # "ranks 2-999: ..." for ranks doing the same thing
            lines.append(f"  rank {first}: {op}" if first == last else f"  ranks {first}-{last}: {op}")
        lines.append("A collective that only some ranks call, or called in a different order, "
                     "hangs like this.")
        super().__init__("\n".join(lines))


def _runs(items: list) -> list:
    """``[(rank, text), ...]`` as ``(first, last, text)`` runs of consecutive ranks with one text."""
    runs: list[list] = []
    for r, text in items:
        if runs and runs[-1][2] == text and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r, text])
    return [tuple(run) for run in runs]


def is_peer_gone(text: str) -> bool:
    """Does this error text only say that the process at the other end went away?"""
    low = text.lower()
    return any(p in low for p in PEER_GONE_PATTERNS)


def last_error_line(text: str, limit: int = 240) -> str:
    """The final non-empty line of a traceback (the exception itself), cut to ``limit`` characters."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    line = lines[-1] if lines else "(no message)"
    return line if len(line) <= limit else line[: limit - 3] + "..."


def describe_exit(exitcode: int | None) -> str:
    """``exited with code 3`` / ``killed by signal SIGKILL (9)`` from a process exit code."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "an unknown signal"
        return f"killed by signal {name} ({-exitcode})"
    return f"exited with code {exitcode}"


def tail(path: str, n: int = 20) -> list[str]:
    """The last ``n`` lines of a text file ([] if it is missing)."""
    try:
        with open(path, errors="replace") as f:
            return f.read().splitlines()[-n:]
    except OSError:
        return []


def death_report(rank: int, exitcode: int | None, err_path: str, last_op: str = "") -> str:
    """What a rank that died without reporting leaves behind: how it ended, what it was doing, and
    the tail of its stderr (``rank{r}.err`` of the run folder)."""
    lines = [f"rank {rank} died without reporting a result: {describe_exit(exitcode)}."]
    if last_op:
        lines.append(f"Its last op: {last_op}")
    err = tail(err_path)
    if err:
        lines.append(f"Last {len(err)} lines of its stderr ({os.path.basename(err_path)}):")
        lines += [f"    {ln}" for ln in err]
    else:
        lines.append("Its stderr was empty.")
    return "\n".join(lines)


def blame(errors: dict, died: set, world_size: int, culprit: int | None = None) -> RankError:
    """The :class:`RankError` for a set of failures. ``errors[r]``: rank r's traceback or death
    report; ``died``: the ranks that died without reporting (always causes). ``culprit`` overrides
    the choice (under torchrun the ranks agree on it through the store)."""
    causes = sorted(r for r, text in errors.items() if r in died or not is_peer_gone(text))
    if culprit is None:
        culprit = causes[0] if causes else min(errors)
    consequences = {r: last_error_line(errors[r]) for r in errors if r != culprit and r not in causes}
    others = tuple(r for r in causes if r != culprit)
    return RankError(culprit, errors[culprit], world_size, consequences=consequences, others=others)
