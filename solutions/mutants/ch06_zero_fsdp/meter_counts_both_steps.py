"""Wrong: puts the warm-up step inside the meter too.

The memory is read in the second step, as it should be; but the wire count covers two steps, twice
the prediction for one.
"""
import torch
import torch.distributed as dist

from minitorch_dist import costmodel
from minitorch_dist.analysis.meters import MemoryMeter
from minitorch_dist.runtime import comm


def meter_zero_stage(make_model, stage: int, x: torch.Tensor, y: torch.Tensor, lr: float = 1e-3) -> dict:
    n = dist.get_world_size()
    model = make_model()
    psi = sum(p.numel() for p in model.parameters())
    predicted = {"model_states": costmodel.zero_memory_bytes(psi, n, stage, k=8, param_bytes=4, grad_bytes=4),
                 "wire": costmodel.zero_comm_bytes(psi, n, stage, bytes_per_element=4)}
    model, opt, inner = _zero_model(model, stage, lr)

    def step(meter=None):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        states = MemoryMeter(model, inner).current() if meter else None
        opt.step()
        return states

    with comm.meter() as m:
        step()
        states = step(meter=True)
    measured = {k: states[k] for k in ("parameters", "gradients", "optimizer_state")}
    measured["model_states"] = sum(measured.values())
    measured["wire"] = m.total_wire_bytes
    return {"predicted": predicted, "measured": measured}
