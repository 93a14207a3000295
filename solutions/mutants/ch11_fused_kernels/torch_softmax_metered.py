"""Wrong: meters ``torch.softmax`` on x instead of the library's five-op eager softmax.

Both compute the softmax, and ``torch.softmax`` is what "eager PyTorch" usually means; but it is one
fused ATen op that moves 2·MN elements, not the five kernels the forecast counts.
"""
import torch


def softmax_traffic_measured(x: torch.Tensor, block: int | None = None) -> dict:
    from minitorch_dist.analysis.meters import ByteCounter

    M, N = x.shape
    with ByteCounter() as c:
        torch.softmax(x, dim=-1)
    return {"read": c.read, "written": c.written, "ops": list(c.ops),
            "predicted": softmax_traffic_forecast(M, N, x.element_size(), block)}
