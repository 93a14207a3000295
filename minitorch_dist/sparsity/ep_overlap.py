"""Chapter 10 — expert parallelism with its all-to-alls hidden behind the experts' compute, by chunking.

Hwang et al. 2023, "Tutel: Adaptive Mixture-of-Experts at Scale" (MLSys), adaptive pipelining: cut
the dispatched tokens into m chunks and let chunk c's experts compute while chunk c+1's all-to-all
travels. Rajbhandari et al. 2022, "DeepSpeed-MoE", §5: the all-to-all is the cost to beat.

Unchunked, a rank of :class:`~.expert_parallel.ExpertParallelMoE` waits for the whole dispatch, then
computes, then waits for the whole combine: both all-to-alls are exposed. Chunked (forward):

    launch dispatch 0; wait dispatch 0
    for c = 0 .. m-1:
        launch dispatch c+1                 (async: travels while ...)
        experts on chunk c                  (... this rank computes)
        launch combine c                    (async)
        wait dispatch c+1
    wait combine 0 .. m-1

Chunks: every (source → destination) block of rows is cut into m nearly equal pieces (the sizes
``torch.tensor_split`` gives); the receiver cuts its blocks the same way from the counts it received,
so both ends agree without another message. Every rank issues its collectives in the same order
(dispatch 0, dispatch 1, combine 0, dispatch 2, combine 1, ...), as gloo and NCCL require. The
result is the unchunked layer's: the same rows meet the same experts, only in smaller matmuls.

An asynchronous collective inside autograd is two functions: :func:`all_to_all_start` launches it
(``async_op=True``) and returns the output buffer, :func:`all_to_all_wait` waits and hands the buffer
on. Backward runs them in reverse: the wait's backward *launches* the reverse all-to-all of the
gradient, the start's backward waits for it, so the backward pass overlaps the same way
(the autograd engine runs the other chunks' expert backward in between). The forward announces
(:mod:`runtime.observe`) the spans "launch dispatch c" / "launch combine c" ("a2a launch"),
"wait dispatch c" / "wait combine c" ("a2a wait") and "experts c" ("experts").

With a dispatch of D seconds, experts of P seconds and a combine of Cb seconds for the whole batch,
per chunk d = D/m + α, p = P/m, c = Cb/m + α, ``costmodel.chunked_moe_layer_time`` steps through this
schedule; when a chunk's compute covers its traffic (p >= d + c) the forward takes d + m·p + c: only
the first dispatch and the last combine stay exposed, instead of D + Cb.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..runtime import comm, observe

__all__ = ["PendingAllToAll", "all_to_all_start", "all_to_all_wait", "chunk_sizes", "split_blocks",
           "chunked_expert_exchange"]


class PendingAllToAll:
    """One all-to-all in flight: its work and send buffer (forward); the reverse all-to-all's work and
    output (backward); its ``name`` (the wait announces the span "wait {name}")."""

    def __init__(self, out_splits, in_splits, group: dist.ProcessGroup | None, name="all-to-all"):
        self.out_splits, self.in_splits, self.group = list(out_splits), list(in_splits), group
        self.name = name
        self.work = self.send = self.bwd_work = self.bwd_send = self.bwd_out = None


def _launch(x, out_splits, in_splits, group: dist.ProcessGroup | None):
    send = x.contiguous()
    out = send.new_empty((sum(out_splits), *send.shape[1:]))
    return out, send, comm.all_to_all(out, send, out_splits, in_splits, group=group, async_op=True)


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, handle):
        out, handle.send, handle.work = _launch(x, handle.out_splits, handle.in_splits, handle.group)
        ctx.handle = handle
        return out

    @staticmethod
    def backward(ctx, _placeholder):
        h = ctx.handle  # the wait's backward launched the reverse all-to-all: wait for it here
        h.bwd_work.wait()
        grad, h.bwd_work, h.bwd_send, h.bwd_out = h.bwd_out, None, None, None
        return grad, None


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, handle):
        with observe.span(f"wait {handle.name}", "a2a wait"):
            handle.work.wait()
        handle.work = handle.send = None
        ctx.handle = handle
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        h = ctx.handle  # launch the reverse all-to-all (splits swapped); the start's backward waits
        h.bwd_out, h.bwd_send, h.bwd_work = _launch(grad, h.in_splits, h.out_splits, h.group)
        return grad, None  # a placeholder: _Start.backward returns the gradient that came back


def all_to_all_start(x: torch.Tensor, out_splits, in_splits, group: dist.ProcessGroup | None = None,
                     name: str = "all-to-all") -> tuple[torch.Tensor, PendingAllToAll]:
    """Launch ``all_to_all_single`` of x's rows (``in_splits[j]`` rows to rank j, ``out_splits[i]``
    from rank i) without waiting. Returns (the output buffer, not to be read yet, and the handle):
    pass both to :func:`all_to_all_wait`. Differentiable through the pair."""
    handle = PendingAllToAll(out_splits, in_splits, group, name)
    return _Start.apply(x, handle), handle


def all_to_all_wait(out: torch.Tensor, handle: PendingAllToAll) -> torch.Tensor:
    """Wait for the all-to-all of ``handle`` (announced as the "a2a wait" span "wait {name}") and
    return its output, now filled."""
    return _Wait.apply(out, handle)


def chunk_sizes(rows: int, chunks: int) -> list[int]:
    """``rows`` cut into ``chunks`` pieces as ``torch.tensor_split`` cuts: the first ``rows % chunks``
    get one row more. ``chunk_sizes(10, 4) == [3, 3, 2, 2]``."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive int, got {chunks!r}")
    q, r = divmod(rows, chunks)
    return [q + (c < r) for c in range(chunks)]


def split_blocks(block_sizes: list[int], chunks: int) -> list[list[int]]:
    """``[m][n]``: how many rows of each of the n blocks chunk c holds (blocks cut by :func:`chunk_sizes`)."""
    per_block = [chunk_sizes(int(s), chunks) for s in block_sizes]
    return [[per_block[j][c] for j in range(len(block_sizes))] for c in range(chunks)]


def _chunk_rows(block_sizes: list[int], parts: list[list[int]], device) -> list[torch.Tensor]:
    """For each chunk, the row indices (into the blocks laid end to end) of its pieces, block by block."""
    starts = [0]
    for s in block_sizes:
        starts.append(starts[-1] + int(s))
    done = [0] * len(block_sizes)
    out = []
    for sizes in parts:
        idx = []
        for j, s in enumerate(sizes):
            idx.append(torch.arange(starts[j] + done[j], starts[j] + done[j] + s, device=device))
            done[j] += s
        out.append(torch.cat(idx))
    return out


def chunked_expert_exchange(run, packed: torch.Tensor, send_counts: list[int], recv_counts: list[int],
                            per_src_expert: torch.Tensor, group: dist.ProcessGroup | None = None,
                            chunks: int = 2) -> torch.Tensor:
    """Dispatch ``packed`` [A, h] (rows grouped by destination rank, ``send_counts[j]`` to rank j), run
    the local experts, and bring the outputs home, in ``chunks`` pipelined pieces (module docstring).

    ``run(rows, counts)`` computes the local experts on rows sorted by local expert (``counts[e]``
    rows each); ``recv_counts[i]`` rows come from rank i, ``per_src_expert[i, e]`` of them for local
    expert e. Returns the expert outputs in ``packed``'s row order."""
    n, n_local = per_src_expert.shape
    dev = packed.device
    send_parts, recv_parts = split_blocks(send_counts, chunks), split_blocks(recv_counts, chunks)
    send_rows = _chunk_rows(send_counts, send_parts, dev)
    # the local expert of every received row, source block by source block (each block expert-sorted)
    expert_of = torch.arange(n_local, device=dev).repeat(n).repeat_interleave(per_src_expert.reshape(-1))
    recv_rows = _chunk_rows(recv_counts, recv_parts, dev)

    def dispatch(c):
        with observe.span(f"launch dispatch {c}", "a2a launch"):  # gather the rows, post the call
            return all_to_all_start(packed[send_rows[c]], recv_parts[c], send_parts[c], group,
                                    f"dispatch {c}")

    pending, back = dispatch(0), []
    for c in range(chunks):
        rows = all_to_all_wait(*pending)
        if c + 1 < chunks:
            pending = dispatch(c + 1)
        with observe.span(f"experts {c}", "experts"):
            ex = expert_of[recv_rows[c]]
            order = torch.sort(ex, stable=True).indices
            out = run(rows[order], torch.bincount(ex, minlength=n_local).tolist())[torch.argsort(order)]
        with observe.span(f"launch combine {c}", "a2a launch"):
            back.append(all_to_all_start(out, send_parts[c], recv_parts[c], group, f"combine {c}"))
    outs = torch.cat([all_to_all_wait(*b) for b in back])
    return outs[torch.argsort(torch.cat(send_rows))]
