"""Wrong: casts x to float32 inside the meter "for accuracy", so the cast and fp32 ops are counted.

Upcasting before a reduction is good numerical practice; but the measurement is of the softmax of x
as given: the cast is an extra kernel, and in fp16 every later op moves twice the bytes.
"""
import torch


def softmax_traffic_measured(x: torch.Tensor, block: int | None = None) -> dict:
    from minitorch_dist.analysis.meters import ByteCounter
    from minitorch_dist.kernels.softmax import softmax_reference

    M, N = x.shape
    with ByteCounter() as c:
        softmax_reference(x.float())
    return {"read": c.read, "written": c.written, "ops": list(c.ops),
            "predicted": softmax_traffic_forecast(M, N, x.element_size(), block)}
