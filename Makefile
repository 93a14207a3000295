# minitorch_dist: every target installs what it needs first (a .venv beside this file).
# torch==2.13.0 is installed *before* the package: a bare "torch" requirement lets pip pick a
# multi-GB CUDA build where a CPU one is wanted.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
TORCH  ?= torch==2.13.0
NBVAL  := --nbval-lax --nbval-current-env --nbval-cell-timeout=300
# What setup installs; CI installs only what the tests need (EXTRAS=test: no JupyterLab).
EXTRAS ?= test,lab
# pytest caches its rewritten test modules as bytecode; where the environment turns bytecode off
# (PYTHONDONTWRITEBYTECODE), every collection rewrites all of them again (seconds per pass).
PYTEST := PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest

.PHONY: setup tour lint book test test-fast test-portability lab notebooks exercises check-exercises grade student-repo figures gpu-report clean
# A student's copy of the course has no solutions/: there `make test` leaves tests/exercises to `make grade`.
NO_SOLUTIONS := $(if $(wildcard solutions),,--ignore=tests/exercises)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	touch $(STAMP)

setup: $(STAMP)                      ## create .venv and install everything

tour: $(STAMP)                       ## one headline experiment per written chapter, as a table
	$(BIN)/python -m minitorch_dist tour

lint: $(STAMP)                       ## ruff over the repository, mypy over runtime/ and the wrappers (pyproject.toml)
	$(BIN)/ruff check .
	$(BIN)/mypy

# mypy (half a minute on one core) runs beside the main pass, whose two workers leave a core idle while
# their tests wait on ranks and subprocesses; its exit status joins the pass's.
test: $(STAMP)                       ## lint, then the whole suite: library, exercises, notebooks (smoke sizes)
	$(BIN)/ruff check .
	$(BIN)/mypy & mypy=$$!; \
	  MTD_SMOKE=1 $(PYTEST) -n 2 --dist loadfile -m "not serial" $(NBVAL) notebooks tests $(NO_SOLUTIONS); \
	  status=$$?; wait $$mypy && exit $$status
	MTD_SMOKE=1 $(PYTEST) -m serial $$($(BIN)/python tests/_passes.py serial)
	MTD_SMOKE=1 $(PYTEST) -n 2 --dist load -m serial $$($(BIN)/python tests/_passes.py deadlines)

# Another MKL code path than the run's own: COMPATIBLE, or AVX2 where the whole run already uses COMPATIBLE.
OTHER_MKL := $(if $(filter COMPATIBLE,$(MKL_CBWR)),AVX2,COMPATIBLE)

test-portability: $(STAMP)           ## the numerics tests again (world size 2), with MKL on another code path (other float rounding)
	MKL_CBWR=$(OTHER_MKL) MTD_SMOKE=1 $(PYTEST) -n 2 --dist loadfile -m "numerics and not serial and not wide" \
	  $$($(BIN)/python tests/_passes.py numerics)

test-fast: $(STAMP)                  ## lint, then library and exercises only, without slow tests
	$(BIN)/ruff check .
	$(BIN)/mypy
	MTD_SMOKE=1 $(PYTEST) -n 2 --dist loadfile -m "not slow and not serial" tests $(NO_SOLUTIONS)
	MTD_SMOKE=1 $(PYTEST) -m "not slow and serial" $$($(BIN)/python tests/_passes.py serial)
	MTD_SMOKE=1 $(PYTEST) -n 2 --dist load -m "not slow and serial" $$($(BIN)/python tests/_passes.py deadlines)

lab: $(STAMP)                        ## JupyterLab on the notebooks
	$(if $(wildcard solutions),,@echo "The cells that answer a *Predict first* prompt have no output here: write your prediction, then run them.")
	$(BIN)/jupyter lab notebooks/

notebooks: $(STAMP)                  ## re-execute every notebook in place at full size, saving outputs
	for nb in notebooks/[0-9]*.ipynb; do \
	  $(BIN)/jupyter nbconvert --to notebook --execute --inplace --ExecutePreprocessor.timeout=600 "$$nb" || exit 1; \
	done

exercises: $(STAMP)                  ## regenerate exercises/ from solutions/ (a filled-in stub is kept; FORCE=1 replaces it)
	$(BIN)/python -m minitorch_dist.course.exercises generate $(if $(FORCE),--force,)

check-exercises: $(STAMP)            ## instructors and CI: stubs in sync, every exercise states kind/time/reference, every mutant rejected
	$(BIN)/python -m minitorch_dist.course.exercises check
	$(BIN)/python -m minitorch_dist.course.statements
	$(BIN)/python -m minitorch_dist.course.mutants --strict

grade: $(STAMP)                      ## grade the exercise stubs (what a student hands in); CH=ch03 for one chapter
	$(BIN)/python -m minitorch_dist grade --impl exercises $(if $(CH),--chapter $(CH),)

student-repo: $(STAMP)               ## a copy of the course without solutions/, to hand out: make student-repo DEST=../course
	@test -n "$(DEST)" || (echo "usage: make student-repo DEST=path/to/new/folder" && exit 2)
	$(BIN)/python -m minitorch_dist.course.student_repo "$(DEST)"

figures: $(STAMP)                    ## redraw the chapters' figures into chapters/figures/*.svg
	$(BIN)/python -m minitorch_dist figures

gpu-report: $(STAMP)                 ## GPU numbers: gpu tests, calibration, busbw, DDP/FSDP vs torch, kernels, GEMMs, MFU
	$(BIN)/python -m minitorch_dist.analysis.gpu_report

BOOK_STAMP := $(VENV)/.book-installed

$(BOOK_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e ".[book]"
	touch $(BOOK_STAMP)

book: $(BOOK_STAMP)                  ## the book as a website in build/book: chapters, notebooks (committed outputs), figures, source
	$(BIN)/python -m minitorch_dist.course.book --out build/book

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info build/book build/book-src
