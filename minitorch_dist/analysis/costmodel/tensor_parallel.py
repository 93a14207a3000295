"""Tensor (intra-layer) model parallelism: the communication of Megatron-LM's layers.

Shoeybi et al. 2019, "Megatron-LM", §3 (the f / g operators: one all-reduce in the forward and
one in the backward per MLP and per attention block); Narayanan et al. 2021, "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", §3.2.
"""
from __future__ import annotations

from .collectives import bus_bytes


def tensor_parallel_allreduces_per_layer() -> dict:
    """All-reduces of b·s·h activations per transformer layer: g after attention's row-parallel
    projection and after the MLP's in the forward, f before both column-parallel inputs in the
    backward (Shoeybi et al. 2019, §3, Fig. 3 and 4)."""
    return {"forward": 2, "backward": 2}


def tensor_parallel_bytes_per_layer(batch, seq, hidden, t, bytes_per_element=2) -> float:
    """Bytes each rank sends per transformer layer per step, forward and backward, under the ring
    model: four all-reduces of b·s·h elements, each 2(t-1)/t of its buffer, i.e.
    ``8 b s h (t-1)/t`` elements (Narayanan et al. 2021, §3.2)."""
    if t < 1 or min(batch, seq, hidden) < 1:
        raise ValueError(f"need t >= 1 and positive batch, seq, hidden; got t={t}, b={batch}, s={seq}, h={hidden}")
    n_allreduce = sum(tensor_parallel_allreduces_per_layer().values())
    return n_allreduce * bus_bytes("all_reduce", batch * seq * hidden * bytes_per_element, t)
