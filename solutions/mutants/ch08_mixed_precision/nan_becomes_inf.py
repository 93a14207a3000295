"""Wrong: forgets that NaNs have low bits too: a NaN can carry into the exponent and come out as inf.

For every finite number and for inf the integer trick is right; a NaN whose mantissa lies in the low
16 bits only is turned into inf, which hides the NaN from every later inf/NaN check.
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
    r = torch.randint(0, 1 << _LOW_BITS, x.shape, generator=generator, dtype=torch.int32, device=x.device)
    rounded = ((bits + r) & -(1 << _LOW_BITS)).view(torch.float32)  # carry into bit 16, then truncate
    return rounded.to(torch.bfloat16)  # exact: the low 16 bits are zero
