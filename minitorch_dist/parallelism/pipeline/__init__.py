"""Chapter 03 — pipeline parallelism in three layers, each readable alone:

* :mod:`.schedules`: pure functions ``(p, m[, v]) -> Schedule``, who runs which F/B/W when (the V-shaped
  ZB-V and DualPipeV in :mod:`.v_schedules`; the vocabulary, Action and Schedule, in :mod:`.actions`);
* :mod:`.simulator`: times a schedule from action durations (makespan, bubble, stashed
  activations) and checks it is a valid dependency order; PipeDream's weight versions;
* :mod:`.executor`: runs any schedule on real ranks for the tiny GPT cut into stages.
"""
from .executor import GPTStage, PipelineResult, local_stages, run_schedule, split_gpt  # noqa: F401
from .pipedream import weight_versions  # noqa: F401
from .schedules import (  # noqa: F401
    SCHEDULES,
    Action,
    Schedule,
    dualpipe_v,
    gpipe,
    interleaved_1f1b,
    make_schedule,
    naive,
    one_f_one_b,
    validate_structure,
    zb_h1,
    zb_v,
)
from .simulator import Simulation, check_dependencies, simulate  # noqa: F401
