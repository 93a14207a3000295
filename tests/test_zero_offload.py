"""Chapter 06: offloading the optimizer (ZeRO-Offload's CPU tier, ZeRO-Infinity's disk tier) changes
where the state lives and what moves, never what is computed.

The reference is the same torch optimizer stepping the same parameter in place, in one process.
An offloaded step runs exactly the same elementwise float32 arithmetic on a copy of the shard
(copies are exact), so the results must be *bitwise* equal -- for SGD with dampening too, whose
first momentum buffer is ``clone(grad)``: a sign that the optimizer's lazily created state is
used as torch creates it. The n = 2 test: each rank steps only its shard; all-gathered, the shards
equal one process stepping the whole padded vector (elementwise optimizers, so again bitwise).

Byte counts are checked against formulas written here from the shard size and the *reference*
optimizer's state size (not the module's): 4·S down and 4·S up per step; for the disk tier the
master and the state read and written once per step, except the first step, which reads no state
(none existed yet). Where the state lives: on disk every state tensor's storage is its file (the
storage reports the file name, and reading the file from outside shows the very same numbers);
the files go away on close() and on garbage collection. This machine has no GPU, so host ==
device: the CPU tier is shown to keep its state in buffers of its own, apart from the device
shard; the `gpu` test checks the devices and pinned memory where CUDA exists.
"""
import gc
import os

import numpy as np
import pytest
import torch

from minitorch_dist.analysis.meters import MemoryMeter, tensor_bytes
from minitorch_dist.memory.zero.flat import shard_range, shard_size
from minitorch_dist.memory.zero.offload import OffloadedOptimizer
from minitorch_dist.runtime import comm
from minitorch_dist.runtime.launch import launch, rank, world_size

pytestmark = pytest.mark.ch06

STEPS = 6
NUMEL = 37  # odd: with n = 2 the last shard carries one element of padding

OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-2),
    "sgd_dampening": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.5, nesterov=False),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
}


def _grads(numel, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=g) for _ in range(steps)]


def _reference(w0, factory, grads):
    """The plain optimizer stepping the parameter in place: final weights and its state."""
    p = torch.nn.Parameter(w0.clone())
    opt = factory([p])
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach(), opt


def _state_bytes(opt):
    return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
               if isinstance(t, torch.Tensor))


@pytest.mark.parametrize("where", ["cpu", "disk"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_offloaded_step_equals_plain_optimizer(where, name):
    w0 = torch.randn(NUMEL, generator=torch.Generator().manual_seed(0))
    grads = _grads(NUMEL, STEPS)
    ref_w, ref_opt = _reference(w0, OPTIMIZERS[name], grads)

    shard = w0.clone()
    with OffloadedOptimizer(shard, OPTIMIZERS[name], where=where) as off:
        for g in grads:
            off.step(g)
            assert not torch.equal(shard, w0), "the device shard was not updated"
        assert torch.equal(shard, ref_w), (shard - ref_w).abs().max()
        assert torch.equal(off.master.detach(), ref_w)

        sd, ref_sd = off.state_dict(), ref_opt.state_dict()
        assert sd["param_groups"] == ref_sd["param_groups"]
        assert sd["state"].keys() == ref_sd["state"].keys() == {0}
        assert sd["state"][0].keys() == ref_sd["state"][0].keys()
        for key, ref_t in ref_sd["state"][0].items():
            t = sd["state"][0][key]
            assert torch.equal(t, ref_t), key
            assert t.untyped_storage().filename is None, "state_dict() must hand back ordinary tensors"

        # bytes moved after k steps, from the formulas (S elements of 4 bytes; B = state bytes)
        S, B, k = NUMEL, _state_bytes(ref_opt), len(grads)
        assert off.bytes_moved["device_to_host"] == 4 * S * k
        assert off.bytes_moved["host_to_device"] == 4 * S * k
        if where == "cpu":
            assert off.bytes_moved["disk_read"] == off.bytes_moved["disk_write"] == 0
        else:
            assert off.bytes_moved["disk_read"] == 4 * S * k + B * (k - 1)  # step 1 had no state to read
            assert off.bytes_moved["disk_write"] == (4 * S + B) * k
    assert sd["state"][0]  # the copy outlives close()


def test_disk_state_lives_in_the_files(tmp_path):
    w0 = torch.randn(NUMEL, generator=torch.Generator().manual_seed(0))
    grads = _grads(NUMEL, 3)
    _, ref_opt = _reference(w0, OPTIMIZERS["adamw"], grads)
    (tmp_path / "keep.txt").write_text("the caller's own file")

    off = OffloadedOptimizer(w0.clone(), OPTIMIZERS["adamw"], where="disk", directory=tmp_path)
    assert os.path.dirname(off.directory) == str(tmp_path)
    assert set(off.files) == {"master"}  # AdamW has no state before its first step
    for g in grads:
        off.step(g)
    state = off.optimizer.state[off.master]
    assert set(off.files) == {"master", *state}

    # every state tensor (and the master) is backed by its own file; none lives in process memory
    backed = {"master": off.master, **state}
    for key, t in backed.items():
        assert t.untyped_storage().filename == off.files[key]
        assert os.path.dirname(off.files[key]) == off.directory
    in_memory = [t for t in state.values() if t.untyped_storage().filename is None]
    assert tensor_bytes(in_memory) == 0
    # the meter sees the state's bytes (the optimizer holds them), and all of them are the files'
    assert MemoryMeter(optimizer=off.optimizer).current()["optimizer_state"] == _state_bytes(ref_opt)
    # read from outside: the files hold exactly the optimizer's current numbers
    for key, t in backed.items():
        on_disk = np.fromfile(off.files[key], dtype=np.float32)[:t.numel()]
        assert np.array_equal(on_disk, t.detach().reshape(-1).numpy()), key
    assert np.array_equal(np.fromfile(off.files["exp_avg_sq"], dtype=np.float32),
                          ref_opt.state[next(iter(ref_opt.state))]["exp_avg_sq"].numpy())

    files = list(off.files.values())
    assert all(os.path.isfile(f) for f in files)
    off.close()
    off.close()  # idempotent
    assert not any(os.path.exists(f) for f in files)
    assert not os.path.exists(off.directory)
    assert (tmp_path / "keep.txt").exists(), "close() must remove only its own folder"
    with pytest.raises(RuntimeError, match="closed"):
        off.step(grads[0])


def test_disk_files_removed_when_collected():
    off = OffloadedOptimizer(torch.zeros(8), OPTIMIZERS["sgd_momentum"], where="disk")
    off.step(torch.ones(8))
    folder, files = off.directory, list(off.files.values())
    assert len(files) == 2 and all(os.path.isfile(f) for f in files)
    del off
    gc.collect()
    assert not os.path.exists(folder)


def test_cpu_state_is_apart_from_the_device_shard():
    """Host == device on this machine, so "off the device" is shown as: the master and every state
    tensor are buffers of the optimizer's own, sharing no memory with the device shard or its
    gradient; the device side (the shard) carries no optimizer state, where a plain optimizer on
    the shard would carry B bytes."""
    shard = torch.zeros(NUMEL)
    grad = torch.ones(NUMEL)
    off = OffloadedOptimizer(shard, OPTIMIZERS["adamw"], where="cpu")
    off.step(grad)
    host = [off.master, *off.optimizer.state[off.master].values()]
    device_ptrs = {shard.untyped_storage().data_ptr(), grad.untyped_storage().data_ptr()}
    assert not device_ptrs & {t.untyped_storage().data_ptr() for t in host}
    assert off.optimizer.param_groups[0]["params"] == [off.master]

    dev = torch.nn.Module()
    dev.shard = torch.nn.Parameter(shard)
    plain = OPTIMIZERS["adamw"](list(dev.parameters()))
    dev.shard.grad = grad
    plain.step()
    assert MemoryMeter(dev, plain).current()["optimizer_state"] == 8 * NUMEL + 4  # exp_avg, exp_avg_sq, step
    assert MemoryMeter(dev).current()["optimizer_state"] == 0  # what the device keeps with offload
    assert MemoryMeter(optimizer=off.optimizer).current()["optimizer_state"] == 8 * NUMEL + 4  # on the host


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["cpu", "disk"])
def test_cuda_shard_offloaded_to_pinned_host(where):
    w0 = torch.randn(NUMEL, generator=torch.Generator().manual_seed(0))
    grads = _grads(NUMEL, STEPS)
    ref_w, _ = _reference(w0, OPTIMIZERS["adamw"], grads)
    shard = w0.cuda()
    with OffloadedOptimizer(shard, OPTIMIZERS["adamw"], where=where) as off:
        for g in grads:
            off.step(g.cuda())
        assert torch.equal(shard.cpu(), ref_w)
        assert off.master.device.type == "cpu"
        assert all(t.device.type == "cpu" for t in off.optimizer.state[off.master].values())
        assert off.master.is_pinned() == (where == "cpu")  # a file mapping is not page-locked


def test_bad_input_is_named():
    f = OPTIMIZERS["sgd_momentum"]
    with pytest.raises(ValueError, match="where must be one of"):
        OffloadedOptimizer(torch.zeros(4), f, where="nvme")
    with pytest.raises(ValueError, match="1-D"):
        OffloadedOptimizer(torch.zeros(2, 2), f)
    with pytest.raises(TypeError, match="floating point"):
        OffloadedOptimizer(torch.zeros(4, dtype=torch.int64), f)
    with pytest.raises(ValueError, match="only used with where='disk'"):
        OffloadedOptimizer(torch.zeros(4), f, where="cpu", directory="/tmp")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        OffloadedOptimizer(torch.zeros(4), f, where="disk", directory="/nonexistent/offload")
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        OffloadedOptimizer(torch.zeros(4), lambda ps: object())
    off = OffloadedOptimizer(torch.zeros(4), f)
    with pytest.raises(ValueError, match="grad_shard has shape"):
        off.step(torch.zeros(5))


def _rank_steps(numel, where, name, steps):
    """Each rank: its shard of the padded vector, its OffloadedOptimizer, all-gather after each step."""
    r, n = rank(), world_size()
    S = shard_size(numel, n)
    lo, hi = shard_range(numel, n, r)
    w0 = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    w0 = torch.nn.functional.pad(w0, (0, n * S - numel))
    full = torch.empty(n * S)
    shard = w0[lo:hi].clone()
    with OffloadedOptimizer(shard, OPTIMIZERS[name], where=where) as off:
        for g in _grads(numel, steps):
            off.step(torch.nn.functional.pad(g, (0, n * S - numel))[lo:hi])
            comm.all_gather(full, shard)
        moved = dict(off.bytes_moved)
    return full[:numel], moved


@pytest.mark.parametrize("where,name", [("cpu", "adamw"), ("disk", "sgd_momentum")])
def test_two_ranks_all_gather_equals_single_process(where, name):
    n = 2
    results = launch(_rank_steps, n, NUMEL, where, name, STEPS, timeout_s=60)
    ref_w, _ = _reference(torch.randn(NUMEL, generator=torch.Generator().manual_seed(0)),
                          OPTIMIZERS[name], _grads(NUMEL, STEPS))
    S = shard_size(NUMEL, n)
    for full, moved in results:
        assert torch.equal(full, ref_w), (full - ref_w).abs().max()
        assert moved["device_to_host"] == moved["host_to_device"] == 4 * S * STEPS
