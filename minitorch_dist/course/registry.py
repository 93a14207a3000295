"""Chapter 00 — the chapter table: the one place that says which chapters exist and where their parts
live.

The tour, the grader, the course tests and the README's chapter map all read `CHAPTERS`.
A chapter is *written* once all five of its parts are committed; `tests/test_course.py` then
holds it to these conventions (so a chapter author can check their work with
``pytest tests/test_course.py``):

- prose ``chapters/NN_slug.md`` with headings (``#``, ``##``, ...) that contain, in any order,
  each keyword of `PROSE_SECTIONS` (case-insensitive): "The problem", "The idea", "The cost",
  "The code", "Measured", "Pitfalls", "Exercises", "Reading". These are the seven parts of a
  chapter in DESIGN.md (the last part, exercises and reading list, has two headings);
- a notebook ``notebooks/NN_slug.ipynb`` committed with its outputs (every code cell executed);
- worked solutions ``solutions/chNN_name.py`` with ``# BEGIN SOLUTION`` / ``# END SOLUTION``
  markers, and stubs ``exercises/chNN_name.py`` generated from them (``make exercises``);
- exercise tests ``tests/exercises/test_chNN_name.py`` named ``test_<exercise>`` or
  ``test_<exercise>_<case>`` (this is how the grader maps tests to exercises), and the chapter's
  pytest marker ``pytest.mark.chNN`` on its tests;
- the library module(s) in `Chapter.modules`, with ``tests/test_<module leaf>.py``;
- optionally a headline experiment ``package.module:function`` (by convention
  ``minitorch_dist.course.headlines.chNN_slug:headline``, outside the library) whose function
  ``headline(smoke: bool) -> dict | list[dict]`` returns rows with keys "chapter",
  "experiment", "theory", "measured", "ok" for ``python -m minitorch_dist tour``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..runtime.tables import format_table

#: The checkout root: the folder that holds the ``minitorch_dist`` package.
REPO_ROOT = Path(__file__).resolve().parents[2]

#: Keywords the prose's headings must contain, one per part of a chapter (see module docstring).
PROSE_SECTIONS = (
    "The problem", "The idea", "The cost", "The code", "Measured", "Pitfalls", "Exercises", "Reading",
)


@dataclass(frozen=True)
class Chapter:
    """One chapter of the course and the paths of its parts (absolute, under `root`)."""

    number: int
    slug: str  # "00_foundations"
    title: str
    modules: tuple[str, ...]  # dotted module names, e.g. ("minitorch_dist.runtime.collectives",)
    written: bool = False
    headline: str | None = None  # "package.module:function" run by the tour
    gpu_only_exercises: tuple[str, ...] = ()  # exercises whose tests need a CUDA GPU
    root: Path = field(default=REPO_ROOT, repr=False, compare=False)

    def __post_init__(self):
        if not self.slug.startswith(f"{self.number:02d}_"):
            raise ValueError(f"chapter slug {self.slug!r} must start with its number {self.number:02d}_")
        if self.headline is not None and ":" not in self.headline:
            raise ValueError(f"headline {self.headline!r} must look like 'package.module:function'")

    @property
    def tag(self) -> str:
        """``ch00``: the short key and the pytest marker."""
        return f"ch{self.number:02d}"

    @property
    def name(self) -> str:
        """The slug without its number: ``foundations``."""
        return self.slug.split("_", 1)[1]

    @property
    def stem(self) -> str:
        """``ch00_foundations``: the file stem of the exercises and solutions."""
        return f"{self.tag}_{self.name}"

    @property
    def prose(self) -> Path:
        return self.root / "chapters" / f"{self.slug}.md"

    @property
    def notebook(self) -> Path:
        return self.root / "notebooks" / f"{self.slug}.ipynb"

    @property
    def exercises(self) -> Path:
        return self.root / "exercises" / f"{self.stem}.py"

    @property
    def solutions(self) -> Path:
        return self.root / "solutions" / f"{self.stem}.py"

    @property
    def exercise_tests(self) -> Path:
        return self.root / "tests" / "exercises" / f"test_{self.stem}.py"

    @property
    def hidden_tests(self) -> Path:
        """An instructor's held-out exercise tests (optional; not in a student's copy). Its own file name:
        two test files of one name in two folders cannot be collected in one session."""
        return self.root / "tests" / "exercises_hidden" / f"test_{self.stem}_held_out.py"

    @property
    def library_tests(self) -> tuple[Path, ...]:
        return tuple(self.root / "tests" / f"test_{m.rsplit('.', 1)[-1]}.py" for m in self.modules)

    @property
    def module_files(self) -> tuple[Path, ...]:
        """Source of each module: ``a/b/c.py``, or ``a/b/c/__init__.py`` for a package."""
        out = []
        for m in self.modules:
            base = self.root.joinpath(*m.split("."))
            out.append(base / "__init__.py" if base.is_dir() else base.with_suffix(".py"))
        return tuple(out)

    def parts(self) -> dict[str, Path]:
        """The files a written chapter must have, by name."""
        return {"prose": self.prose, "notebook": self.notebook, "exercises": self.exercises,
                "solutions": self.solutions, "exercise tests": self.exercise_tests}

    def rel(self, path: Path) -> str:
        """`path` relative to the chapter's root, for messages."""
        try:
            return str(Path(path).relative_to(self.root))
        except ValueError:
            return str(path)


_M = "minitorch_dist."
_HL = _M + "course.headlines."  # one module of tour rows per chapter
CHAPTERS: tuple[Chapter, ...] = (
    Chapter(0, "00_foundations", "Foundations: ranks, collectives and their cost",
            (_M + "runtime.collectives",), written=True,
            headline=_HL + "ch00_foundations:headline"),
    Chapter(1, "01_data_parallel", "Data parallelism: all-reduce, buckets, overlap",
            (_M + "parallelism.data_parallel", _M + "parallelism.large_batch"), written=True,
            headline=_HL + "ch01_data_parallel:headline"),
    Chapter(2, "02_parameter_servers", "Parameter servers (BSP, ASP, SSP) and HOGWILD!",
            (_M + "parallelism.parameter_server", _M + "parallelism.hogwild"), written=True,
            headline=_HL + "ch02_parameter_servers:headline"),
    Chapter(3, "03_pipeline", "Pipeline parallelism: GPipe, 1F1B, interleaving, zero bubble",
            (_M + "parallelism.pipeline",), written=True,
            headline=_HL + "ch03_pipeline:headline"),
    Chapter(4, "04_tensor_parallel", "Tensor parallelism: Megatron-LM layers",
            (_M + "parallelism.tensor_parallel", _M + "parallelism.tensor_parallel_vocab",
             _M + "parallelism.mappings"), written=True,
            headline=_HL + "ch04_tensor_parallel:headline"),
    Chapter(5, "05_sequence_parallel",
            "Sequence and context parallelism: Megatron SP, Ulysses, ring attention",
            (_M + "parallelism.sequence_parallel.megatron_sp", _M + "parallelism.sequence_parallel.ulysses",
             _M + "parallelism.sequence_parallel.ring_attention"), written=True,
            headline=_HL + "ch05_sequence_parallel:headline"),
    Chapter(6, "06_zero_fsdp", "ZeRO and fully sharded data parallelism: sharded states, offload, Adafactor",
            (_M + "memory.zero", _M + "memory.adafactor"), written=True,
            headline=_HL + "ch06_zero_fsdp:headline"),
    Chapter(7, "07_checkpointing", "Activation checkpointing: recomputation, the √n rule, selective, offload",
            (_M + "memory.checkpointing", _M + "memory.activation_offload"), written=True,
            headline=_HL + "ch07_checkpointing:headline"),
    Chapter(8, "08_mixed_precision", "Mixed precision training: master weights, loss scaling, bf16, fp8",
            (_M + "memory.mixed_precision", _M + "memory.fp8", _M + "memory.fp8_linear"), written=True,
            headline=_HL + "ch08_mixed_precision:headline"),
    Chapter(9, "09_compression", "Gradient compression: top-k, 1-bit, QSGD, PowerSGD, error feedback; Gist",
            (_M + "communication.compression", _M + "communication.activation_compression"), written=True,
            headline=_HL + "ch09_compression:headline"),
    Chapter(10, "10_moe", "Mixture of experts: routers, capacity, load balancing, expert parallelism",
            (_M + "sparsity.moe", _M + "sparsity.expert_parallel", _M + "sparsity.moe_gpt"), written=True,
            headline=_HL + "ch10_moe:headline"),
    Chapter(11, "11_fused_kernels",
            "Fused kernels in Triton: softmax, LayerNorm, AdamW, cross-entropy, FlashAttention; the roofline",
            (_M + "kernels",), written=True, headline=_HL + "ch11_fused_kernels:headline"),
    Chapter(12, "12_putting_it_together", "Putting it together: 3D parallelism and planning",
            (_M + "parallelism.mesh", _M + "parallelism.three_d", _M + "analysis.planner"), written=True,
            headline=_HL + "ch12_putting_it_together:headline"),
    Chapter(13, "13_resilience", "Saving, resharding and surviving failures",
            (_M + "resilience",), written=True, headline=_HL + "ch13_resilience:headline"),
    Chapter(14, "14_measuring", "Appendix — measuring time on the machine you have",
            (_M + "analysis.predict", _M + "costmodel.step_time", _M + "runtime.timing"), written=True),
)


class UnknownChapter(KeyError):
    """No chapter matches the key; the message lists the valid keys."""

    def __str__(self):
        return str(self.args[0])


def chapter(key: int | str | Chapter) -> Chapter:
    """Look a chapter up by number (``0``, ``"0"``), tag (``"ch00"``), or slug (``"00_foundations"``)."""
    if isinstance(key, Chapter):
        return key
    k = str(key).strip().lower()
    for ch in CHAPTERS:
        if k in (ch.tag, ch.slug, ch.stem, ch.name) or (k.isdigit() and int(k) == ch.number):
            return ch
    valid = ", ".join(ch.tag for ch in CHAPTERS)
    raise UnknownChapter(f"no chapter {key!r}; use a number 0-{len(CHAPTERS) - 1}, a tag ({valid}), "
                   f"or a slug such as {CHAPTERS[0].slug!r}")


def written_chapters() -> list[Chapter]:
    """The chapters whose five parts are committed, in order."""
    return [ch for ch in CHAPTERS if ch.written]


def planned_table(chapters=CHAPTERS) -> str:
    """The chapter map: tag, title, module(s), and whether it is written."""
    rows = [[ch.tag, ch.title, ", ".join(m.removeprefix(_M) for m in ch.modules),
             "written" if ch.written else "planned"] for ch in chapters]
    return format_table(rows, ["chapter", "title", "module", "status"])
