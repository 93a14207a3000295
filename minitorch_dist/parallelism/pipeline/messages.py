"""Chapter 03 — the point-to-point traffic of one pipeline step: activations forward, their gradients
back, each message tagged so that it matches whatever order the ranks post in.

Narayanan et al. 2021 (Megatron-LM §2.2): consecutive virtual stages exchange one activation and one
gradient per microbatch. Where two consecutive virtual stages sit on the same rank (the turn of a V:
ZB-V, Qi et al. 2024 §6; DualPipeV, DeepSeek-V3 §3.2.1) the tensor is handed over in memory instead.
:mod:`.executor` runs the schedule and calls this module for every input and output.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ...runtime import comm

__all__ = ["Messages"]


class Messages:
    """The step's point-to-point traffic. Every message is tagged (microbatch, receiving virtual stage,
    activation|gradient); sends are non-blocking and kept alive until :meth:`wait`. A receive is posted
    one action ahead (:meth:`post`) and waited for when its action starts (:meth:`recv`): the sender then
    finds the receiver ready and the message moves as it is sent, instead of waiting, on a busy machine,
    for the sender's communication thread to get a core after the receiver asks (chapter 03, "a send
    posted during compute")."""

    def __init__(self, schedule, group: dist.ProcessGroup | None, shape, like: torch.Tensor):
        self.schedule, self.group, self.shape, self.like = schedule, group, shape, like
        self.n_vs = schedule.p * schedule.v
        self.pending: list = []  # (work, tensor): the tensor must outlive its send
        self.posted: dict = {}  # (vs_from, mb, vs, grad) -> (works, buffer) of a receive posted early
        self.handed: dict = {}  # (mb, vs, grad) -> tensor from a chunk of this same rank

    def _peer(self, vs: int) -> int:
        """Global rank holding virtual stage ``vs``."""
        r = self.schedule.placement(vs)[0]
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def _local(self, vs: int) -> bool:
        """Whether virtual stage ``vs`` is on this rank (the turn of a V): no message, a hand-over."""
        return self.schedule.placement(vs)[0] == dist.get_rank(self.group)

    def _tag(self, mb: int, vs: int, grad: int) -> int:
        return 2 * (mb * self.n_vs + vs) + grad

    def send(self, t: torch.Tensor, vs_to: int, mb: int, grad: int) -> None:
        t = t.detach().contiguous()
        if self._local(vs_to):
            self.handed[(mb, vs_to, grad)] = t
            return
        op = dist.P2POp(dist.isend, t, self._peer(vs_to), self.group, self._tag(mb, vs_to, grad))
        works = comm.batch_isend_irecv([op])
        if dist.get_backend(self.group) == "fake":
            return  # a dry run's fake group sends nothing and never reports a send complete: keep nothing
        self.pending.extend((w, t) for w in works)
        self.pending[:] = [(w, t) for w, t in self.pending if not w.is_completed()]

    def post(self, vs_from: int, mb: int, vs: int, grad: int) -> None:
        """Post the receive of one message now (non-blocking); :meth:`recv` waits for it."""
        key = (vs_from, mb, vs, grad)
        if key not in self.posted and not self._local(vs_from):
            buf = torch.empty(self.shape, dtype=self.like.dtype, device=self.like.device)  # boundary shape
            op = dist.P2POp(dist.irecv, buf, self._peer(vs_from), self.group, self._tag(mb, vs, grad))
            self.posted[key] = (comm.batch_isend_irecv([op]), buf)

    def ready(self, vs_from: int, mb: int, vs: int, grad: int) -> None:
        """Wait until the message has arrived (posted now unless it was); :meth:`recv` then takes it."""
        if self._local(vs_from):
            return
        self.post(vs_from, mb, vs, grad)
        works, buf = self.posted[(vs_from, mb, vs, grad)]
        for w in works:
            w.wait()
        self.posted[(vs_from, mb, vs, grad)] = ([], buf)

    def recv(self, vs_from: int, mb: int, vs: int, grad: int) -> torch.Tensor:
        """The message, once arrived (posted now unless :meth:`post` did it earlier)."""
        if self._local(vs_from):
            if (mb, vs, grad) not in self.handed:
                raise RuntimeError(f"virtual stage {vs} needs the {'gradient' if grad else 'activation'} of "
                                   f"microbatch {mb} from virtual stage {vs_from} on this same rank, which "
                                   f"has not run yet; the schedule's order deadlocks (check it with "
                                   f"simulator.check_dependencies)")
            return self.handed.pop((mb, vs, grad))
        self.ready(vs_from, mb, vs, grad)
        return self.posted.pop((vs_from, mb, vs, grad))[1]

    def wait(self) -> None:
        for w, _ in self.pending:
            w.wait()
