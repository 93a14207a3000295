"""Chapter 02 — the tour's rows: BSP == synchronous SGD; SSP's staleness bound holds; ASP converges."""
from __future__ import annotations

from ...parallelism.parameter_server import LeastSquares, run_parameter_server, synchronous_sgd


def headline(smoke: bool = False) -> list[dict]:
    """Chapter 02's rows: BSP == synchronous SGD; SSP's staleness bound holds and binds; ASP converges."""
    clocks = 30  # each run takes about a second
    bsp = run_parameter_server("bsp", clocks=clocks)
    ref = synchronous_sgd(LeastSquares(), clocks, lr=0.2)
    diff = (bsp["params"] - ref).abs().max().item()
    ssp = run_parameter_server("ssp", staleness=2, clocks=clocks, straggler={3: 0.02})
    asp = run_parameter_server("asp", clocks=clocks)
    gap = asp["loss"] - asp["loss_opt"]
    return [
        {"chapter": "ch02",
         "experiment": f"BSP, 2 servers x 2 workers, {clocks} clocks == synchronous SGD, max |Δx|",
         "theory": 1e-6, "measured": diff, "ok": diff < 1e-6},
        {"chapter": "ch02", "experiment": "SSP(s=2) with a straggler: max observed staleness (clocks)",
         "theory": 2, "measured": max(ssp["staleness"]), "ok": max(ssp["staleness"]) <= 2},
        {"chapter": "ch02", "experiment": f"ASP on least squares, {clocks} clocks: loss - optimum",
         "theory": 1e-2, "measured": gap, "ok": gap < 1e-2},
    ]
