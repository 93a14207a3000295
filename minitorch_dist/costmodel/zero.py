"""Chapter 06 — ZeRO beyond memory: bytes on the wire per stage, the paper's Table 1, and offload traffic.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", §5 (Table 1) and §7 (communication analysis); Ren et al. 2021, "ZeRO-Offload", §3;
Rajbhandari et al. 2021, "ZeRO-Infinity", §4. The per-device memory formula itself,
:func:`~.memory.zero_memory_bytes`, lives with the other model-state formulas in :mod:`.memory`.
"""
from __future__ import annotations

from .memory import zero_memory_bytes

#: The model sizes (Psi) and DP degrees (N_d) of ZeRO's Table 1.
TABLE1_MODELS = (7.5e9, 128e9, 1e12)
TABLE1_DP = (1, 4, 16, 64, 256, 1024)
#: Table 1 as the paper prints it (GB per device; P_os, P_os+g, P_os+g+p), digits kept as printed.
TABLE1_PRINTED = {
    1: {7.5e9: ("120", "120", "120"), 128e9: ("2048", "2048", "2048"), 1e12: ("16000", "16000", "16000")},
    4: {7.5e9: ("52.5", "41.3", "30"), 128e9: ("896", "704", "512"), 1e12: ("7000", "5500", "4000")},
    16: {7.5e9: ("35.6", "21.6", "7.5"), 128e9: ("608", "368", "128"), 1e12: ("4750", "2875", "1000")},
    64: {7.5e9: ("31.4", "16.6", "1.88"), 128e9: ("536", "284", "32"), 1e12: ("4187", "2218", "250")},
    256: {7.5e9: ("30.4", "15.4", "0.47"), 128e9: ("518", "263", "8"), 1e12: ("4046", "2054", "62.5")},
    1024: {7.5e9: ("30.1", "15.1", "0.12"), 128e9: ("513", "257", "2"), 1e12: ("4011", "2013", "15.6")},
}


def zero_comm_bytes(num_params, dp, stage, bytes_per_element=2) -> float:
    """Bytes one rank sends per training step under ZeRO-DP ``stage``, ring model.

    ZeRO §7.2: plain data parallelism all-reduces the gradients, a reduce-scatter plus an
    all-gather, 2*Psi elements. With P_os and P_os+g (stages 1, 2) the gradients are
    reduce-scattered and the updated parameters all-gathered: the same 2*Psi -- "ZeRO-DP with
    P_os and P_g incurs no additional communication". With P_os+g+p (stage 3) the parameters
    are all-gathered before the forward and again before the backward, and the gradients
    reduce-scattered: 3*Psi, "1.5x" of the baseline (§7.2.2). Each collective moves
    (n-1)/n of its buffer per rank (the ring model of :func:`~.collectives.bus_bytes`)::

        stages 0, 1, 2:   2 * Psi * (n-1)/n * e
        stage 3:          3 * Psi * (n-1)/n * e

    ``e`` = ``bytes_per_element`` (2 for the paper's fp16, 4 for fp32 training). A flat buffer
    padded to a multiple of n moves n*ceil(Psi/n) elements: pass that as ``num_params`` to
    compare with a meter.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    if dp < 1:
        raise ValueError(f"data-parallel degree must be >= 1, got {dp}")
    passes = 3 if stage == 3 else 2  # whole-model passes through a reduce-scatter or all-gather
    return passes * num_params * (dp - 1) / dp * bytes_per_element


def zero_table1(models=TABLE1_MODELS, dps=TABLE1_DP, k=12) -> dict:
    """ZeRO's Table 1: per-device model-state memory in GB (1e9 bytes) for each model size and
    DP degree, under P_os, P_os+g and P_os+g+p (stages 1, 2, 3), 16-bit parameters and
    gradients, K = 12 (Rajbhandari et al. 2020, §5, Table 1; formula §5.1-5.3).

    Returns ``{dp: {num_params: (stage1_GB, stage2_GB, stage3_GB)}}``; the DP = 1 row is also
    stage 0. The paper prints three significant figures below 100 GB and truncates larger
    values to whole GB (4187.5 is printed 4187, 257.75 is printed 257), so every printed
    number lies within one unit of its last digit of this formula.
    """
    return {dp: {psi: tuple(zero_memory_bytes(psi, dp, stage, k=k) / 1e9 for stage in (1, 2, 3))
                 for psi in models}
            for dp in dps}


OFFLOAD_TIERS = ("cpu", "disk")


def offload_bytes_per_step(shard_numel, where, k_bytes=8, param_bytes=4, grad_bytes=4,
                           state_bytes=None) -> dict:
    """Bytes an offloaded optimizer moves per step for its shard of S = ``shard_numel`` elements.

    ZeRO-Offload (Ren et al. 2021, §3): the gradient shard goes down to the host, the host
    runs the optimizer step, the updated parameters come back up -- the minimum traffic of any
    offload that keeps forward and backward on the device (4M bytes for an fp16 model of M parameters, §3.3)::

        device_to_host = grad_bytes * S       host_to_device = param_bytes * S

    ZeRO-Infinity's NVMe tier (Rajbhandari et al. 2021, §4; "disk" here): the fp32 master copy
    and the K bytes of optimizer state live on disk and must be read and written once per
    step ("optimizer states must be read and written at least once")::

        disk_read = disk_write = (param_bytes + k_bytes) * S

    Defaults are fp32 training with AdamW: 4-byte gradients and parameters, K = 8 (m and v).
    ``state_bytes`` replaces K*S by the state's exact size (torch's AdamW adds a 4-byte step
    counter). Keys match ``OffloadedOptimizer.bytes_moved``, whose first step reads no state
    (the optimizer creates it then).
    """
    if where not in OFFLOAD_TIERS:
        raise ValueError(f"offload target must be one of {OFFLOAD_TIERS}, got {where!r}")
    if shard_numel < 0:
        raise ValueError(f"shard_numel must be >= 0, got {shard_numel}")
    S = shard_numel
    state = k_bytes * S if state_bytes is None else state_bytes
    disk = param_bytes * S + state if where == "disk" else 0
    return {"device_to_host": grad_bytes * S, "host_to_device": param_bytes * S,
            "disk_read": disk, "disk_write": disk}


def fsdp_unit_elements(unit_numel: int, n_tensors: int, n: int, reshard_after_forward: bool = True) -> dict:
    """Elements one FSDP unit of ``unit_numel`` parameters in ``n_tensors`` tensors puts into its
    collectives per training step on n ranks (the buffers' sizes; the wire carries (n-1)/n of them).

    ZeRO §7.2.2 / FSDP §3: the unit's flat buffer, padded to ``n*S`` with ``S = ceil(Psi_u / n)``,
    is all-gathered before the forward and, when it was resharded after the forward, again before
    the backward; its gradient is reduce-scattered once. The course's reduce-scatter carries one
    has-a-gradient flag per tensor in each of the n chunks, so a parameter no rank computed a
    gradient for is left alone by the optimizer (``memory.zero.fsdp_unit``)::

        all_gather     (1 + reshard_after_forward) * n*S
        reduce_scatter n*S + n*F          (F = n_tensors)
    """
    if n < 1 or unit_numel < 1 or n_tensors < 1:
        raise ValueError(f"need n >= 1, unit_numel >= 1, n_tensors >= 1; got {n}, {unit_numel}, {n_tensors}")
    padded = n * -(-unit_numel // n)
    return {"all_gather": (2 if reshard_after_forward else 1) * padded,
            "reduce_scatter": padded + n * n_tensors}
