"""Wrong: predicts fail_step mod every steps lost: the steps since the checkpoint, not the one in progress.

"Half an interval on average" suggests counting the finished steps only; the job also redoes the
step it died in, so the prediction is one short, and 0 for a failure in a checkpoint's first step.
"""
def measure_lost_steps(cfg, steps: int, every: int, fail_step: int, folder) -> dict:
    from minitorch_dist.resilience.elastic import Failure, run_elastic

    run = run_elastic(lambda n: "zero3", [2, 2], cfg, 4, 16, steps, every, folder,
                      fail=Failure(1, fail_step))
    lost = run.lost_work()[0]
    return {"predicted": fail_step % every, "resumed_from": lost["resumed_from"],
            "steps_redone": lost["steps_redone"]}
