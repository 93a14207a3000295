"""Wrong: reports the forecast's bytes as the measurement; nothing runs under the meter.

The forecast is exact for these five ops, so its numbers are right; but nothing was measured, the
op list is empty, and a softmax that moved other bytes would go unseen.
"""
import torch


def softmax_traffic_measured(x: torch.Tensor, block: int | None = None) -> dict:
    M, N = x.shape
    predicted = softmax_traffic_forecast(M, N, x.element_size(), block)
    eager = cm.softmax_bytes(M, N, x.element_size(), fused=False)
    return {"read": eager["read"], "written": eager["written"], "ops": [], "predicted": predicted}
