"""Chapter 14 — machine profiles: the measured (or cited) numbers every time prediction starts from.

A time prediction is only as good as the machine description it is fed. The course never uses a free
"efficiency" knob: every rate comes from a *profile*, either measured here by
``python -m minitorch_dist calibrate`` or shipped for a GPU with a citation for each number
(``h100``, ``h200``, ``a100``: JSON files beside this module). A profile holds:

    matmul            seconds of one fp32 / bf16 GEMM against its FLOPs, a table measured (or cited)
                      with every rank busy at once, as in a real step; interpolated log-log
    op_overhead_s     the fixed cost of one eager op (Python dispatch + kernel launch)
    copy_bytes_per_s  bytes an elementwise op moves per second (memory bandwidth of one rank)
    collectives       α (seconds per ring step) and β (seconds per byte) of each collective, fitted
                      to a size sweep at ``world_size`` ranks (Hockney's model, ``costmodel.collectives``)
    collective_overhead_s   the Python-level cost of one metered collective call, above α
    overlap           the fraction of an asynchronous collective's time hidden under compute that runs
                      at the same moment (0: the communication takes the core from the computation)
    async_start_s     (calibrated) how long an asynchronous message waits to start moving while its
                      rank keeps computing (a CPU's scheduler quantum; 0 where a copy engine moves it)
    python_line_s     (calibrated) the cost of one line of Python the step executes between its ops
    reference_step_s  (calibrated) one whole step of the tiny GPT on a rank, timed at calibration: timed
                      again later, it says how much slower (busier) the machine has become since
    kernels           (calibrated) every op the course's techniques run, by name and shapes, timed alone
    framework_overhead_s  (calibrated) the cost per op that the ops alone do not explain in a whole step
    peak_flops        the dense peak per device, for MFU (datasheet; a CPU's: the best measured GEMM)

The formulas that turn these into seconds live in :mod:`..costmodel.step_time`; this module only
loads, checks and saves profiles. ``load_profile("h100")`` reads a shipped one, ``load_profile(path)``
a file; a file missing a key, or with a rate that is not a finite number of the right sign (a negative
bandwidth, a NaN latency: every time computed from it would be meaningless), is refused with the key
and the file named.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["COLLECTIVES", "SHIPPED", "REQUIRED", "MachineProfile", "load_profile", "default_profile_path",
           "shipped_path", "monotone", "check_rates"]

#: The collectives a profile times (``send`` is one point-to-point message: a pipeline's).
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send")
#: Shipped profiles by name.
SHIPPED = ("h100", "h200", "a100")
#: Keys every profile must have (``sources`` and ``notes`` are optional).
REQUIRED = ("name", "device", "kind", "world_size", "threads_per_rank", "memory_bytes", "peak_flops",
            "matmul", "op_overhead_s", "copy_bytes_per_s", "collective_overhead_s", "collectives", "overlap")

#: Rates that must be finite and > 0 (a time is divided by them, or they are the times of a table).
POSITIVE = ("world_size", "threads_per_rank", "memory_bytes", "copy_bytes_per_s")
#: Costs that must be finite and >= 0: a calibration may find one too small to see (0).
NON_NEGATIVE = ("op_overhead_s", "collective_overhead_s", "framework_overhead_s", "async_start_s",
                "python_line_s", "reference_step_s")

_HERE = Path(__file__).resolve().parent


@dataclass
class MachineProfile:
    """One machine's rates (see the module docstring); every time formula reads them from here."""

    name: str
    device: str
    kind: str  # "calibrated" (measured here) or "shipped" (datasheets and published measurements)
    world_size: int  # ranks the collectives were measured on (a node, for a shipped GPU profile)
    threads_per_rank: int
    memory_bytes: float
    peak_flops: dict  # dtype -> FLOP/s
    matmul: dict  # dtype -> [[flops, seconds], ...] ascending in flops
    op_overhead_s: float
    copy_bytes_per_s: float
    collective_overhead_s: float
    collectives: dict  # op -> {"alpha_s": α, "beta_s_per_byte": β}
    overlap: float
    framework_overhead_s: float = 0.0  # per op, beyond its kernel: Python, dispatch, autograd (calibrated)
    async_start_s: float = 0.0  # an asynchronous send waits this long to start while its rank computes
    python_line_s: float = 0.0  # one Python line of the framework around the ops (calibrated)
    reference_step_s: float = 0.0  # the tiny GPT's step on one rank when calibrated (0: not measured)
    kernels: dict = field(default_factory=dict)  # workload.Op.key -> seconds, timed alone (calibrated)
    collective_sweeps: dict = field(default_factory=dict)  # op -> [[bytes, seconds], ...] at world_size
    inter_node: dict | None = None  # {"alpha_s", "beta_s_per_byte"} between nodes (shipped GPU profiles)
    gpus_per_node: int | None = None
    hardware: str = ""
    created: str = ""
    sources: dict = field(default_factory=dict)  # key -> citation
    notes: list = field(default_factory=list)

    # --- reading the rates -----------------------------------------------------------------------------
    def matmul_seconds(self, flops: float, dtype: str = "fp32") -> float:
        """Seconds of one GEMM of ``flops`` FLOPs: the table interpolated on log-log axes; below its
        smallest entry the smallest entry's time (a launch-bound floor), above its largest the largest
        entry's rate."""
        if flops <= 0:
            return 0.0
        table = self.matmul.get(dtype) or self.matmul["fp32"]
        if flops <= table[0][0]:
            return table[0][1]
        if flops >= table[-1][0]:
            return table[-1][1] * flops / table[-1][0]
        return _loglog(table, flops)

    def swept_seconds(self, op: str, nbytes: float, n: int) -> float | None:
        """The measured sweep of ``op`` interpolated at ``nbytes`` (log-log), when it was measured on
        ``n`` ranks and ``nbytes`` lies inside it; None otherwise (the α-β fit stands in). The sweep is
        first made non-decreasing (:func:`monotone`): a larger message never takes less time, and where
        the measured means say otherwise on a busy machine, their pooled mean is the better estimate."""
        sweep = self.collective_sweeps.get("send" if op == "recv" else op)
        if not sweep or (n != self.world_size and op not in ("send", "recv")):
            return None
        if not sweep[0][0] <= nbytes <= sweep[-1][0]:
            return None
        return _loglog(monotone(sweep), nbytes)

    def alpha_beta(self, op: str) -> tuple[float, float]:
        """(α, β) of collective ``op`` (``recv`` is charged to its ``send``)."""
        c = self.collectives["send" if op == "recv" else op]
        return c["alpha_s"], c["beta_s_per_byte"]

    # --- files -----------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return asdict(self)

    def save(self, path) -> Path:
        path = Path(path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    @classmethod
    def from_dict(cls, data: dict, where: str = "the profile") -> MachineProfile:
        missing = [k for k in REQUIRED if k not in data]
        if missing:
            raise ValueError(f"{where} lacks {', '.join(missing)}: write a complete one with "
                             f"`python -m minitorch_dist calibrate --out PATH`, or use a shipped one "
                             f"({', '.join(SHIPPED)})")
        absent = [op for op in COLLECTIVES if op not in data["collectives"]]
        if absent:
            raise ValueError(f"{where} has no α, β for {', '.join(absent)}: recalibrate with "
                             f"`python -m minitorch_dist calibrate`")
        for op, c in data["collectives"].items():
            if not {"alpha_s", "beta_s_per_byte"} <= set(c):
                raise ValueError(f"{where}: collectives.{op} needs alpha_s and beta_s_per_byte")
        if "fp32" not in data["matmul"] or len(data["matmul"]["fp32"]) < 2:
            raise ValueError(f"{where}: matmul.fp32 needs at least two [flops, seconds] points")
        check_rates(data, where)
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})


def _rates(data: dict):
    """(field, value, must be > 0) for every rate of a profile's ``data``, named as in the file."""
    yield from ((k, data[k], True) for k in POSITIVE)
    yield from ((k, data[k], False) for k in NON_NEGATIVE if k in data)
    yield "overlap", data["overlap"], False
    yield from ((f"peak_flops.{k}", v, True) for k, v in data["peak_flops"].items())
    sweeps = data.get("collective_sweeps") or {}
    for what, tables in (("matmul", data["matmul"]), ("collective_sweeps", sweeps)):
        for key, table in tables.items():
            for i, point in enumerate(table):
                if not isinstance(point, (list, tuple)) or len(point) != 2:
                    raise ValueError(f"{what}.{key}[{i}] is {point!r}, not a [size, seconds] pair")
                yield from ((f"{what}.{key}[{i}][{j}]", v, True) for j, v in enumerate(point))
    links = {f"collectives.{op}": c for op, c in data["collectives"].items()}
    if data.get("inter_node") is not None:
        links["inter_node"] = data["inter_node"]
    for where, c in links.items():
        yield from ((f"{where}.{k}", c[k], False) for k in ("alpha_s", "beta_s_per_byte"))
    yield from ((f"kernels[{k!r}]", v, False) for k, v in (data.get("kernels") or {}).items())


def check_rates(data: dict, where: str = "the profile") -> None:
    """Refuse a profile ``data`` with a rate that is not a finite number > 0 (bandwidths, memory, peaks,
    table entries) or >= 0 (latencies and overheads, which may measure 0), or an overlap above 1;
    the ``ValueError`` names the field and ``where`` (the file)."""
    try:
        rates = list(_rates(data))
    except ValueError as e:
        raise ValueError(f"{where}: {e}; recalibrate, or fix the file") from None
    for name, v, positive in rates:
        number = isinstance(v, (int, float)) and not isinstance(v, bool)
        if not (number and math.isfinite(v) and (v > 0 if positive else v >= 0)):
            raise ValueError(f"{where}: {name} is {v!r}; it must be a finite number "
                             f"{'> 0' if positive else '>= 0'}. Recalibrate with `python -m minitorch_dist "
                             f"calibrate --out PATH`, or fix the file")
    if data["overlap"] > 1:
        raise ValueError(f"{where}: overlap is {data['overlap']!r}; it is a fraction of a collective's time, "
                         f"between 0 and 1. Recalibrate, or fix the file")


def monotone(sweep) -> list:
    """The non-decreasing curve closest to ``sweep`` ([[bytes, seconds], ...], ascending in bytes) in
    least squares: pool-adjacent-violators (Ayer et al. 1955) -- wherever a size took less time than a
    smaller one, the run of them is replaced by its mean. An increasing sweep comes back unchanged."""
    blocks: list = []  # [mean seconds, number of sizes pooled]
    for _, t in sweep:
        blocks.append([t, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (t1, n1), (t2, n2) = blocks.pop(-2), blocks.pop()
            blocks.append([(t1 * n1 + t2 * n2) / (n1 + n2), n1 + n2])
    times = [t for t, n in blocks for _ in range(n)]
    return [[size, t] for (size, _), t in zip(sweep, times)]


def _loglog(table, x: float) -> float:
    """``table`` ([[x, y], ...], ascending in x) interpolated at ``x`` on log-log axes (x inside it)."""
    for (x0, y0), (x1, y1) in zip(table, table[1:]):
        if x0 <= x <= x1:
            if x1 == x0:
                return y0
            w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return math.exp(math.log(y0) + w * (math.log(y1) - math.log(y0)))
    return table[0][1] if x < table[0][0] else table[-1][1]


def shipped_path(name: str) -> Path:
    return _HERE / f"{name}.json"


def default_profile_path() -> Path:
    """Where ``calibrate`` writes by default: ``$MTD_PROFILE`` if set, else the user's cache directory
    (``$XDG_CACHE_HOME`` or ``~/.cache``) / minitorch_dist / profile.json."""
    if os.environ.get("MTD_PROFILE"):
        return Path(os.environ["MTD_PROFILE"]).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "minitorch_dist" / "profile.json"


def load_profile(which=None) -> MachineProfile:
    """A profile: a shipped name (``h100``, ``h200``, ``a100``), a path to a JSON file, or None for this
    machine's calibrated profile at :func:`default_profile_path` (a clear error if there is none)."""
    if isinstance(which, MachineProfile):
        return which
    if which is None:
        path = default_profile_path()
        if not path.exists():
            raise ValueError(f"no calibrated profile at {path}: run `python -m minitorch_dist calibrate` "
                             f"first (under a minute), or pass --profile h100|h200|a100|PATH")
    elif str(which).lower() in SHIPPED:
        path = shipped_path(str(which).lower())
    else:
        path = Path(which).expanduser()
        if not path.exists():
            raise ValueError(f"profile {which!r} is neither a shipped name ({', '.join(SHIPPED)}) nor a "
                             f"file; run `python -m minitorch_dist calibrate --out {which}` to make it")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"profile {path} is not valid JSON ({e}); recalibrate or fix the file") from None
    return MachineProfile.from_dict(data, where=f"profile {path}")
