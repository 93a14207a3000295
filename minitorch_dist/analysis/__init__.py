"""Chapter 00 — analysis: the cost model (theory), meters and timelines (measured), the planner."""
