"""Chapter 01 — splitting the work over ranks: data parallelism (01), parameter servers (02),
pipelines (03), tensors (04), sequences (05), all three at once (12)."""
