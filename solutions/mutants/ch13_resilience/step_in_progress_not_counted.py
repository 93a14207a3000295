"""Wrong: measures the steps redone as fail_step - resumed_from, leaving out the step that was in progress.

The steps finished since the checkpoint are the obvious loss; but the step the rank died in had
computed its gradients, and the next attempt computes it again too.
"""
def measure_lost_steps(cfg, steps: int, every: int, fail_step: int, folder) -> dict:
    from minitorch_dist.resilience.elastic import Failure, run_elastic

    predicted = lost_steps(fail_step, every)
    run = run_elastic(lambda n: "zero3", [2, 2], cfg, 4, 16, steps, every, folder,
                      fail=Failure(1, fail_step))
    resumed = run.lost_work()[0]["resumed_from"]
    return {"predicted": predicted, "resumed_from": resumed, "steps_redone": fail_step - resumed}
