"""Wrong: draws its random bits from the global generator, not from the one passed in.

The rounding is as unbiased as ever; but a seeded generator no longer makes it reproducible, and every
call moves the global stream that dropout and data shuffling draw from.
"""
import torch


def stochastic_round_to_bf16(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"x must be a float32 tensor, got {got}; call x.float() first")
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator (e.g. torch.Generator().manual_seed(0)), "
                        f"got {type(generator).__name__}")
    if generator.device.type != x.device.type:
        raise ValueError(f"generator is on {generator.device} but x is on {x.device}; "
                         f"make the generator with torch.Generator(device=x.device)")
    bits = x.contiguous().view(torch.int32)
    r = torch.randint(0, 1 << _LOW_BITS, x.shape, dtype=torch.int32, device=x.device)
    rounded = ((bits + r) & -(1 << _LOW_BITS)).view(torch.float32)  # carry into bit 16, then truncate
    rounded = torch.where(torch.isnan(x), x, rounded)  # a NaN's carry could make it inf
    return rounded.to(torch.bfloat16)  # exact: the low 16 bits are zero
