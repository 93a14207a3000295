"""Chapter 00 — collectives built from point-to-point messages: ring, recursive doubling, binomial
tree, naive.

Chapter 00. Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms for clusters of
workstations"; Thakur, Rabenseifner & Gropp 2005, "Optimization of collective communication
operations in MPICH" (§4.1 all-gather, §4.4 all-reduce, §4.5 reduce-scatter).

**The alpha-beta model** (Hockney): a message of m bytes costs ``alpha + m*beta``, alpha the
latency, 1/beta the bandwidth. An algorithm costs (sequential steps)*alpha + (bytes a rank sends)*beta.

**Why the ring is bandwidth-optimal.** All-reduce S bytes on n ranks, cut into n chunks. In a
reduce-scatter, rank k's contribution to each of the n-1 chunks it does not own exists nowhere
else, so it must leave rank k: at least (n-1)/n*S bytes sent per rank. In an all-gather each rank
lacks n-1 reduced chunks and must receive them: (n-1)/n*S per rank again, and what is received
was sent. An all-reduce needs both (Patarasuk & Yuan derive 2(n-1)/n*S as a tight lower bound),
and the ring meets both bounds exactly: n-1 steps of each, every rank sending one S/n chunk to
its right neighbour while receiving one from its left, so
``t_ring = 2(n-1)*alpha + 2(n-1)/n*S*beta``; the beta term tends to 2*S*beta however large n grows.

**When latency-optimal wins.** The ring pays 2(n-1) latencies. Recursive doubling pays log2(n)
but sends all of S in each step, ``log2(n)*(alpha + S*beta)``; a binomial tree (reduce, then
broadcast) pays twice that. For small S or large n alpha dominates and the log-step algorithms
win; for large S the ring's 2*S*beta wins. MPICH and NCCL switch on message size likewise.

Conventions, as in torch.distributed:

- Every all-reduce here sums **in place**, like ``dist.all_reduce(t)``, and returns ``t`` too.
- A tensor of N elements is cut into n chunks the way ``torch.tensor_split(t.flatten(), n)``
  does (:func:`chunk_sizes`): the first N mod n chunks hold ceil(N/n) elements, the rest floor(N/n).
  Rank r owns chunk r, as in ``reduce_scatter_tensor``.
- Sums are in the tensor's dtype (bf16 adds in bf16, as torch does). Algorithms add in
  different orders, so they agree with ``dist.all_reduce`` up to rounding: n-1 additions in any
  order land within ``(n-1) * eps/2 * sum_k |x_k|`` of the exact sum (Higham's bound, eps/2 the
  unit roundoff), so two orders differ by at most ``(n-1) * eps * sum_k |x_k|``. With n = 2 there
  is one addition and a + b == b + a: the results are bitwise equal.

**Bytes.** Every message goes through :mod:`comm`, so the comm meter counts the real bytes sent
(see :func:`metered`). In the ring, rank r sends every chunk but its own during reduce-scatter
and every chunk but chunk r+1 during all-gather::

    sent_r = (2N - |c_r| - |c_(r+1)|) * itemsize

which is exactly ``2(n-1)/n * S`` (``busbw.bus_bytes("all_reduce", S, n)``) when n divides
N. Otherwise each chunk is within (n-1)/n of an element of N/n, so sent_r differs from the
formula by at most ``2(n-1)/n * itemsize`` (under two elements), and the sum over all ranks is
still exactly ``2(n-1) * S``. Reduce-scatter alone sends ``(N - |c_r|)*itemsize``, all-gather
``(N - |c_(r+1)|)*itemsize``: each within ``(n-1)/n * itemsize`` of ``(n-1)/n * S``.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from . import comm
from .groups import require_process_group

__all__ = ["chunk_sizes", "ring_reduce_scatter", "ring_all_gather", "ring_all_reduce",
           "recursive_doubling_all_reduce", "tree_all_reduce", "naive_all_reduce", "metered",
           "time_collective"]


# --- plumbing: who am I, who are my neighbours, one overlapped exchange ------------------------


def _rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_initialized():
        if group is not None:
            require_process_group("a collective on a given group")
        return 0, 1  # a single process: every collective is the identity
    r = dist.get_rank(group)
    if r < 0:
        raise ValueError("this rank is not a member of `group`; only the group's ranks may call "
                         "its collectives")
    return r, dist.get_world_size(group)


def _peer(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """The global rank of ``group_rank``: send/recv address ranks globally, even within a group."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D view sharing ``tensor``'s memory (so writes land in ``tensor``)."""
    if not tensor.is_contiguous():
        raise ValueError("tensor must be contiguous (torch.distributed requires it too); pass t.contiguous()")
    return tensor.view(-1)


def _exchange(send_buf: torch.Tensor, dst: int, recv_buf: torch.Tensor, src: int,
              group: dist.ProcessGroup | None) -> None:
    """Send ``send_buf`` to ``dst`` while receiving ``recv_buf`` from ``src``; wait for both.

    Posting both before waiting keeps the ring from deadlocking (each rank blocked in a send to a
    neighbour blocked in its own send); ``batch_isend_irecv`` lets NCCL, too, run them together.
    Empty chunks (numel < n) are not sent at all."""
    ops = []
    if send_buf.numel():
        ops.append(dist.P2POp(dist.isend, send_buf, dst, group))
    if recv_buf.numel():
        ops.append(dist.P2POp(dist.irecv, recv_buf, src, group))
    if ops:
        for work in comm.batch_isend_irecv(ops):
            work.wait()


def chunk_sizes(numel: int, n: int) -> list[int]:
    """Element counts of the n chunks of a numel-element tensor, as ``torch.tensor_split``
    cuts it: the first ``numel % n`` chunks get one element more. ``chunk_sizes(10, 4) == [3, 3, 2, 2]``."""
    q, k = divmod(numel, n)
    return [q + 1] * k + [q] * (n - k)


# --- the ring (Patarasuk & Yuan 2009; Thakur et al. 2005 §4.4) ----------------------------------


def _ring(flat: torch.Tensor, group: dist.ProcessGroup | None, reduce: bool) -> list[torch.Tensor]:
    """n-1 ring steps over the chunks of ``flat``; each rank sends right and receives from the left.

    reduce=True (reduce-scatter): at step s rank r sends chunk r-s-1 and adds the incoming chunk
    r-s-2 into its own copy, so after n-1 steps chunk r holds the sum of all n ranks' chunk r.
    reduce=False (all-gather): rank r starts with chunk r complete; at step s it forwards chunk
    r-s and stores chunk r-s-1, so after n-1 steps it has every chunk. Returns the chunk views.
    """
    r, n = _rank_and_size(group)
    chunks = list(flat.split(chunk_sizes(flat.numel(), n)))
    right, left = _peer(group, (r + 1) % n), _peer(group, (r - 1) % n)
    first = r - 1 if reduce else r
    for s in range(n - 1):
        send_i, recv_i = (first - s) % n, (first - s - 1) % n
        incoming = torch.empty_like(chunks[recv_i]) if reduce else chunks[recv_i]
        _exchange(chunks[send_i], right, incoming, left, group)
        if reduce:
            chunks[recv_i].add_(incoming)
    return chunks


def ring_reduce_scatter(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Ring reduce-scatter: return this rank's chunk of the sum over ranks (1-D, chunk r of
    :func:`chunk_sizes`), like ``reduce_scatter_tensor`` but for any numel. ``tensor`` is left
    untouched (we reduce into a copy). n-1 steps; sends ``(N - |c_r|) * itemsize`` bytes."""
    return _ring(_flat(tensor).clone(), group, reduce=True)[_rank_and_size(group)[0]]


def ring_all_gather(chunk: torch.Tensor, group: dist.ProcessGroup | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Ring all-gather: every rank's ``chunk``, concatenated in rank order, like ``all_gather_into_tensor``.

    Without ``out`` the chunks must be of equal size and the result is 1-D. With ``out`` (any
    shape), ``out``'s numel decides the chunk sizes (:func:`chunk_sizes`) and the result is
    written into ``out`` and returned. n-1 steps; sends ``(N - |c_(r+1)|) * itemsize`` bytes.
    """
    r, n = _rank_and_size(group)
    if out is None:
        out = chunk.new_empty(n * chunk.numel())
    if out.dtype != chunk.dtype:
        raise ValueError(f"out is {out.dtype} but chunk is {chunk.dtype}; they must match")
    share = chunk_sizes(out.numel(), n)[r]
    if chunk.numel() != share:
        raise ValueError(f"rank {r}'s chunk has {chunk.numel()} elements, but its share of out "
                         f"({out.numel()} elements over {n} ranks, cut as torch.tensor_split) is {share}")
    flat = _flat(out)
    list(flat.split(chunk_sizes(flat.numel(), n)))[r].copy_(chunk.reshape(-1))
    _ring(flat, group, reduce=False)
    return out


def ring_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Ring all-reduce (SUM, in place) = ring reduce-scatter + ring all-gather.

    ``t = 2(n-1)*alpha + 2(n-1)/n*S*beta`` (``costmodel.allreduce_time``). The reduce-scatter
    works in ``tensor``'s own memory (its other chunks hold partial sums until the all-gather
    overwrites them with the final ones), so no extra copy of the tensor is made.
    """
    _ring(_flat(tensor), group, reduce=True)
    _ring(_flat(tensor), group, reduce=False)
    return tensor


# --- latency-optimal: log2(n) steps (Thakur et al. 2005 §4.4) -----------------------------------


def recursive_doubling_all_reduce(tensor: torch.Tensor,
                                  group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Recursive doubling (SUM, in place): in round k rank r swaps its whole buffer with rank
    r XOR 2^k and both add, so after log2(n) rounds every rank holds the sum.

    Non-powers of two use the standard fold: with p the largest power of two <= n, rank p+i
    first sends its data to rank i, ranks 0..p-1 run the rounds, then rank i sends the result
    back. Messages sent per rank: log2(p) (plus 1 for ranks i < n-p, just 1 for ranks >= p),
    never more than ceil(log2 n); sequential steps: log2(p) + 2 when n is not a power of two.
    Model: ``costmodel.recursive_doubling_allreduce_time`` = ceil(log2 n)*(alpha + S*beta).
    """
    r, n = _rank_and_size(group)
    flat = _flat(tensor)
    p = 1 << (n.bit_length() - 1)  # the largest power of two <= n
    if r >= p:  # an extra rank: hand the data to a partner, wait for the result
        comm.send(flat, _peer(group, r - p), group)
        comm.recv(flat, _peer(group, r - p), group)
        return tensor
    incoming = torch.empty_like(flat)
    if r < n - p:
        comm.recv(incoming, _peer(group, r + p), group)
        flat.add_(incoming)
    mask = 1
    while mask < p:
        partner = _peer(group, r ^ mask)
        _exchange(flat, partner, incoming, partner, group)
        flat.add_(incoming)  # mine + theirs == theirs + mine bitwise: both partners agree exactly
        mask <<= 1
    if r < n - p:
        comm.send(flat, _peer(group, r + p), group)
    return tensor


def tree_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Binomial-tree reduce to rank 0, then binomial-tree broadcast back (SUM, in place).

    Reduce: in round k, ranks with bit k set send their partial sum to r - 2^k and drop out.
    Broadcast: the same tree reversed; rank r receives from r minus its lowest set bit, then
    forwards to r + 2^j for each lower bit j, farthest first. 2*ceil(log2 n) steps of S bytes
    (``costmodel.tree_allreduce_time``); 2(n-1) messages in all, rank 0 sends ceil(log2 n).
    """
    r, n = _rank_and_size(group)
    flat = _flat(tensor)
    incoming = torch.empty_like(flat)
    mask = 1
    while mask < n:  # reduce
        if r & mask:
            comm.send(flat, _peer(group, r - mask), group)
            break
        if r + mask < n:
            comm.recv(incoming, _peer(group, r + mask), group)
            flat.add_(incoming)
        mask <<= 1
    lowbit = r & -r
    if r:  # broadcast
        comm.recv(flat, _peer(group, r - lowbit), group)
    mask = (lowbit if r else 1 << (n - 1).bit_length()) >> 1
    while mask:
        if r + mask < n:
            comm.send(flat, _peer(group, r + mask), group)
        mask >>= 1
    return tensor


def naive_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Everyone sends to rank 0, rank 0 sums and sends the result back (SUM, in place).

    Rank 0 sends (n-1)*S bytes and receives as much; every other rank sends S. Through one port
    that is ``2(n-1)*(alpha + S*beta)`` (``costmodel.naive_allreduce_time``): linear in n, the
    bottleneck the ring removes by spreading the same traffic evenly over all links.
    """
    r, n = _rank_and_size(group)
    flat = _flat(tensor)
    if r == 0:
        incoming = torch.empty_like(flat)
        for src in range(1, n):
            comm.recv(incoming, _peer(group, src), group)
            flat.add_(incoming)
        for dst in range(1, n):
            comm.send(flat, _peer(group, dst), group)
    else:
        comm.send(flat, _peer(group, 0), group)
        comm.recv(flat, _peer(group, 0), group)
    return tensor


# --- counting and timing -----------------------------------------------------------------------


def metered(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, int, int]:
    """Run ``fn(*args, **kwargs)`` under a comm meter; return ``(result, bytes_sent, messages_sent)``
    of this rank, e.g. ``out, nbytes, nmsg = metered(ring_all_reduce, t)``."""
    with comm.meter() as m:
        result = fn(*args, **kwargs)
    return result, m.bytes["send"], m.calls["send"]


def time_collective(fn: Callable[[torch.Tensor], object], sizes_bytes: Iterable[float],
                    repeats: int = 5) -> list[float]:
    """Seconds ``fn(t)`` takes on a float32 tensor of each size, best of ``repeats`` (call inside
    launch; e.g. ``fn=dist.all_reduce`` or :func:`ring_all_reduce`).

    Every repetition starts from a barrier so the ranks enter together, after one warm-up call
    (connections, allocations). The best run is the one least disturbed by the OS scheduler.
    """
    times = []
    for nbytes in sizes_bytes:
        t = torch.ones(max(1, int(nbytes) // 4))
        fn(t.clone())
        best = math.inf
        for _ in range(repeats):
            x = t.clone()
            dist.barrier()
            t0 = time.perf_counter()
            fn(x)
            best = min(best, time.perf_counter() - t0)
        times.append(best)
    return times
