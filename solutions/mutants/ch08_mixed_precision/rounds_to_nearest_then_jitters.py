"""Wrong: adds the random low bits and then rounds to nearest, instead of truncating.

"Add noise, then round" sounds like stochastic rounding; but after adding r in [0, 2^16) the carry has
already done the rounding, and rounding to nearest on top moves the threshold by half an ulp: the result
is biased away from zero."""
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
    r = torch.randint(0, 1 << _LOW_BITS, x.shape, generator=generator, dtype=torch.int32, device=x.device)
    rounded = (bits + r).view(torch.float32).to(torch.bfloat16).float()  # noise, then round to nearest
    rounded = torch.where(torch.isnan(x), x, rounded)  # a NaN's carry could make it inf
    return rounded.to(torch.bfloat16)  # exact: the low 16 bits are zero
