"""Wrong: reports the schedule's arithmetic as the measurement; no job runs.

The prediction is exact for this job, so computing "resumed from" and "steps redone" from the save
schedule gives the right numbers; but nothing was measured, and a driver that saved or resumed
differently would go unseen.
"""
def measure_lost_steps(cfg, steps: int, every: int, fail_step: int, folder) -> dict:

    predicted = lost_steps(fail_step, every)
    resumed = fail_step // every * every
    return {"predicted": predicted, "resumed_from": resumed, "steps_redone": predicted}
