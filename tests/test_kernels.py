"""Chapter 11: every Triton kernel equals its PyTorch reference, forward and backward.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (minitorch_dist.kernels sets
TRITON_INTERPRET=1 before defining them); with one they run compiled on CUDA tensors. Shapes are
drawn at random (seeded) and include widths that are not powers of two, so every kernel's masked
tail is exercised, and narrow blocks that make the kernels loop over column / vocabulary blocks.
The interpreter runs programs one after another, so shapes stay small. The `gpu` tests check the
chapter's bandwidth claim and skip with a reason on CPU machines.
"""
import copy
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

if importlib.util.find_spec("triton") is None:  # find, not import: the package must import triton first
    pytest.skip("chapter 11 needs Triton: pip install triton", allow_module_level=True)

from minitorch_dist import kernels as K  # noqa: E402
from minitorch_dist.kernels import _runtime  # noqa: E402
from minitorch_dist.models.gpt import GPT, GPTConfig  # noqa: E402

pytestmark = pytest.mark.ch11
DEV = K.default_device()


def gen(seed):
    return torch.Generator().manual_seed(seed)


def randn(g, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(DEV, dtype)


def random_shapes(seed, k, max_rows=16, max_cols=700):
    """k (rows, cols) drawn at random; the fixed ones add a single column, an exact power of two
    and one past it."""
    g = gen(seed)
    drawn = [(int(torch.randint(1, max_rows + 1, (), generator=g)),
              int(torch.randint(1, max_cols + 1, (), generator=g))) for _ in range(k)]
    return drawn + [(3, 1), (4, 256), (2, 257)]


def close(a, b, atol, rtol=1e-5):
    torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=rtol)


# --- where the kernels run ------------------------------------------------------------------------


def test_backend_follows_the_machine():
    user_set = os.environ.get("TRITON_INTERPRET") not in (None, "", "0")
    if torch.cuda.is_available() and not user_set:
        assert K.backend() == "cuda" and DEV.type == "cuda"
    else:
        assert K.backend() == "interpreter" and DEV.type == "cpu"
        assert os.environ["TRITON_INTERPRET"] == "1"


# Each kernel's signature for an ahead-of-time compile: pointer dtypes, int / float scalars, constexprs.
_COMPILE = {
    "softmax._softmax_fwd_kernel": ("*fp32 *fp32 i32 i32 i32", [1024]),
    "softmax._softmax_fwd_online_kernel": ("*fp16 *fp16 i32 i32 i32", [1024]),
    "softmax._softmax_bwd_kernel": ("*bf16 *bf16 *bf16 i32 i32 i32 i32", [1024]),
    "layernorm._layernorm_fwd_kernel": ("*fp16 *fp16 *fp32 *fp32 *fp32 *fp32 i32 i32 i32 fp32", [True, 1024]),
    "layernorm._layernorm_bwd_dx_kernel": ("*fp32 " * 8 + "i32 i32 i32 i32 i32 i32", [False, 1024]),
    "layernorm._layernorm_bwd_dwdb_kernel": ("*fp32 *fp32 *fp32 *fp32 i32 i32", [True, 32, 128]),
    "adamw._adamw_kernel": ("*fp32 *fp32 *fp32 *fp32 i32" + " fp32" * 7, [1024]),
    "cross_entropy._cross_entropy_kernel": ("*fp16 *i64 *fp32 *fp16 *fp32 i32 i32 i32 i32", [True, 4096]),
}


def test_every_kernel_compiles_for_an_h100_without_one(tmp_path):
    # The interpreter runs the Python of a kernel; the GPU path goes through Triton's compiler, which
    # rejects things the interpreter lets pass (loop-carried types, int64 loop bounds...). Compile each
    # kernel to PTX for sm_90 (ptxas ships with triton), in a process where TRITON_INTERPRET=0.
    code = f"""
import importlib, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
for name, (sig, consts) in {_COMPILE!r}.items():
    module, kernel = name.split(".")
    fn = getattr(importlib.import_module("minitorch_dist.kernels." + module), kernel)
    args = fn.arg_names
    types = sig.split() + ["constexpr"] * len(consts)
    src = ASTSource(fn, dict(zip(args, types)),
                    {{(len(args) - len(consts) + i,): c for i, c in enumerate(consts)}})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={{"num_warps": 4}}).asm["ptx"]
    assert ".target sm_90" in ptx, name
"""
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.skipif(not _runtime.INTERPRET, reason="concerns the interpreter only")
def test_interpreter_repairs_a_triton_imported_before_it(monkeypatch):
    # `import triton` before TRITON_INTERPRET=1 (torch.compile does it) builds tl.max & co. for the
    # GPU; recreate that state, then check _runtime rebuilds them so interpreted kernels still run.
    from triton.runtime.jit import JITFunction

    tl = _runtime.tl
    for module in (tl, tl.standard):
        for name in ("max", "sum"):
            monkeypatch.setattr(module, name, JITFunction(getattr(tl.standard, name).fn))
    x = randn(gen(0), 3, 50)
    with pytest.raises(Exception, match="outside of the scope of a kernel"):
        K.softmax(x)
    _runtime._interpret_triton_library()
    close(K.softmax(x), torch.softmax(x, dim=-1), atol=1e-6)


def test_compiled_backend_rejects_cpu_tensors_with_the_fix(monkeypatch):
    monkeypatch.setattr(_runtime, "INTERPRET", False)
    with pytest.raises(ValueError, match=r"compiled for CUDA.*\.cuda\(\).*TRITON_INTERPRET=1"):
        _runtime.check_device(torch.zeros(3))


# --- softmax --------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", random_shapes(0, 4) + [(2, 3, 17)])
def test_softmax_forward_equals_reference(shape):
    x = randn(gen(1), *shape, scale=3.0)
    y = K.softmax(x)
    close(y, K.softmax_reference(x), atol=1e-6)
    close(y, torch.softmax(x, dim=-1), atol=1e-6)


@pytest.mark.parametrize("dtype, atol", [(torch.float16, 1e-3), (torch.bfloat16, 8e-3)])
def test_softmax_half_precision_computes_in_fp32(dtype, atol):
    x = randn(gen(2), 5, 333, dtype=dtype, scale=4.0)
    y = K.softmax(x)
    assert y.dtype == dtype
    close(y, torch.softmax(x.float(), dim=-1), atol=atol)


@pytest.mark.parametrize("N", [1, 64, 65, 1000])
def test_online_softmax_streams_long_rows_in_blocks(N):
    x = randn(gen(3), 3, N, scale=5.0)
    x[0, : min(N - 1, 130)] = -float("inf")  # a leading block of only -inf: the rescaling guard
    close(K.softmax_forward(x, block_size=64), torch.softmax(x, dim=-1), atol=1e-6)


def test_softmax_is_stable_for_large_logits_and_masks():
    x = randn(gen(4), 4, 200, scale=1e4)
    x[:, 100:] = -float("inf")  # masked-attention style rows
    y = K.softmax(x)
    assert torch.isfinite(y).all()
    close(y, torch.softmax(x, dim=-1), atol=1e-6)


@pytest.mark.parametrize("block_size", [None, 32])
@pytest.mark.parametrize("shape", random_shapes(5, 2, max_rows=8, max_cols=300))
def test_softmax_backward_equals_autograd(shape, block_size):
    g = gen(6)
    x, dy = randn(g, *shape, scale=2.0).requires_grad_(), randn(g, *shape)
    (dx,) = torch.autograd.grad(K.softmax(x, block_size=block_size), x, dy)
    (ref,) = torch.autograd.grad(torch.softmax(x, dim=-1), x, dy)
    close(dx, ref, atol=1e-6)


def test_softmax_takes_strided_inputs():
    base = randn(gen(7), 6, 300)
    rows = base[:, :250]  # row stride 300: used in place
    assert _runtime.as_rows(rows).data_ptr() == rows.data_ptr()
    close(K.softmax(rows), torch.softmax(rows, dim=-1), atol=1e-6)
    cols = base.t()  # strided last dimension: copied once
    close(K.softmax(cols), torch.softmax(cols, dim=-1), atol=1e-6)
    assert K.softmax(randn(gen(7), 0, 5)).shape == (0, 5)


def test_softmax_rejects_bad_input_clearly():
    with pytest.raises(TypeError, match="floating"):
        K.softmax(torch.ones(2, 3, dtype=torch.int64, device=DEV))
    with pytest.raises(ValueError, match="0-dim"):
        K.softmax(torch.tensor(1.0, device=DEV))
    with pytest.raises(TypeError, match=r"float64.*\.float\(\)"):
        K.softmax(torch.ones(2, 3, dtype=torch.float64, device=DEV))
    with pytest.raises(ValueError, match="power of two"):
        K.softmax_forward(torch.ones(2, 3, device=DEV), block_size=48)
    with pytest.raises(ValueError, match="differ in shape"):
        K.softmax_backward(torch.ones(2, 3, device=DEV), torch.ones(2, 4, device=DEV))


# --- LayerNorm ------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", random_shapes(10, 3))
def test_layernorm_forward_equals_reference(shape, bias):
    g = gen(11)
    x, w = randn(g, *shape, scale=3.0) + 1.0, randn(g, shape[-1])
    b = randn(g, shape[-1]) if bias else None
    y, mean, rstd = K.layernorm_forward(x, w, b, eps=1e-5)
    close(y, K.layernorm_reference(x, w, b, 1e-5), atol=2e-5)
    var, mu = torch.var_mean(x, dim=-1, unbiased=False)
    close(mean, mu, atol=1e-5)
    close(rstd, torch.rsqrt(var + 1e-5), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("N", [64, 300, 1000])
def test_layernorm_forward_loops_over_column_blocks(N):
    g = gen(12)
    x, w, b = randn(g, 3, 2, N, scale=2.0), randn(g, N), randn(g, N)
    y, _, _ = K.layernorm_forward(x, w, b, block_size=64)
    close(y, F.layer_norm(x, (N,), w, b), atol=2e-5)


def test_layernorm_fp16_computes_in_fp32():
    g = gen(13)
    x, w, b = (randn(g, 6, 333, dtype=torch.float16, scale=3.0), randn(g, 333, dtype=torch.float16),
               randn(g, 333, dtype=torch.float16))
    y = K.layer_norm(x, w, b)
    assert y.dtype == torch.float16
    close(y, F.layer_norm(x.float(), (333,), w.float(), b.float()), atol=5e-3, rtol=1e-3)


@pytest.mark.parametrize("groups", [1, 3, "one row each", None])
@pytest.mark.parametrize("shape, bias", [((13, 257), True), ((7, 96), False), ((1, 5), True)])
def test_layernorm_backward_equals_autograd(shape, bias, groups):
    g = gen(14)
    x, dy = randn(g, *shape, scale=2.0), randn(g, *shape)
    w, b = randn(g, shape[-1]), (randn(g, shape[-1]) if bias else None)
    _, mean, rstd = K.layernorm_forward(x, w, b)
    groups = {1: 1, 3: min(3, shape[0]), "one row each": shape[0], None: None}[groups]  # None: the default
    dx, dw, db = K.layernorm_backward(dy, x, w, mean, rstd, has_bias=bias, groups=groups)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    br = b.clone().requires_grad_() if bias else None
    F.layer_norm(xr, (shape[-1],), wr, br).backward(dy)
    close(dx, xr.grad, atol=2e-5)
    close(dw, wr.grad, atol=5e-5)
    if bias:
        close(db, br.grad, atol=5e-5)
    else:
        assert db is None


def test_layer_norm_autograd_function_3d_fp16():
    g = gen(15)
    x = randn(g, 2, 5, 130, dtype=torch.float16).requires_grad_()
    w = randn(g, 130, dtype=torch.float16).requires_grad_()
    b = randn(g, 130, dtype=torch.float16).requires_grad_()
    dy = randn(g, 2, 5, 130, dtype=torch.float16)
    ours = torch.autograd.grad(K.layer_norm(x, w, b), (x, w, b), dy)
    leaves = [t.detach().float().requires_grad_() for t in (x, w, b)]
    ref = torch.autograd.grad(F.layer_norm(leaves[0], (130,), leaves[1], leaves[2]), leaves, dy.float())
    for a, r in zip(ours, ref):
        assert a.dtype == torch.float16
        close(a, r, atol=2e-2, rtol=1e-2)


def test_layernorm_module_is_a_drop_in_for_nn_layernorm():
    g = gen(16)
    ref = torch.nn.LayerNorm(70).to(DEV)
    with torch.no_grad():
        ref.weight.copy_(randn(g, 70))
        ref.bias.copy_(randn(g, 70))
    ours = K.LayerNorm(70).to(DEV)
    ours.load_state_dict(ref.state_dict())
    x = randn(g, 4, 70)
    close(ours(x), ref(x), atol=1e-5)
    ours(x).square().sum().backward()
    ref(x).square().sum().backward()
    close(ours.weight.grad, ref.weight.grad, atol=1e-4)
    close(ours.bias.grad, ref.bias.grad, atol=1e-4)


def test_replace_layernorms_in_a_gpt_keeps_loss_and_gradients():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=50, block_size=8, n_layer=1, n_head=2, n_embd=24)
    ref = GPT(cfg).to(DEV)
    model = copy.deepcopy(ref)
    params_before = [id(p) for p in model.parameters()]
    K.replace_layernorms(model)
    assert [id(p) for p in model.parameters()] == params_before
    assert sum(isinstance(m, K.LayerNorm) for m in model.modules()) == 3  # ln_1, ln_2, ln_f
    idx = torch.randint(0, 50, (2, 8), generator=gen(17)).to(DEV)
    _, loss = model(idx, idx)
    _, ref_loss = ref(idx, idx)
    close(loss, ref_loss, atol=1e-5)
    loss.backward()
    ref_loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-5, msg=name)


def test_layernorm_rejects_bad_input_clearly():
    x, w = torch.ones(2, 8, device=DEV), torch.ones(8, device=DEV)
    with pytest.raises(ValueError, match=r"weight has shape \(7,\).*last dimension is 8"):
        K.layer_norm(x, torch.ones(7, device=DEV))
    with pytest.raises(ValueError, match="needs a weight"):
        K.layer_norm(x, None)
    with pytest.raises(ValueError, match="groups must be in"):
        _, mean, rstd = K.layernorm_forward(x, w)
        K.layernorm_backward(x, x, w, mean, rstd, groups=3)
    wide = torch.ones(1, 16385, device=DEV)
    _, mean, rstd = K.layernorm_forward(wide, torch.ones(16385, device=DEV))
    with pytest.raises(ValueError, match="N = 16385 is wider.*torch.nn.LayerNorm"):
        K.layernorm_backward(wide, wide, torch.ones(16385, device=DEV), mean, rstd)
    with pytest.raises(ValueError, match="last dimension only"):
        K.LayerNorm((4, 8))
    with pytest.raises(ValueError, match="elementwise_affine=True"):
        K.LayerNorm(8, elementwise_affine=False)


# --- AdamW ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("n, weight_decay", [(1, 0.0), (1000, 0.1), (4097, 0.01)])
def test_fused_adamw_step_equals_reference(n, weight_decay):
    g = gen(20)
    p = randn(g, n)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    p_ref, m_ref, v_ref = p.clone(), m.clone(), v.clone()
    hyper = dict(lr=3e-3, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=weight_decay)
    for step in range(1, 4):
        grad = randn(g, n)
        K.fused_adamw_step(p, grad, m, v, step=step, **hyper)
        K.adamw_reference(p_ref, grad, m_ref, v_ref, step=step, **hyper)
    close(p, p_ref, atol=1e-7, rtol=1e-6)
    close(m, m_ref, atol=1e-7, rtol=1e-6)
    close(v, v_ref, atol=1e-8, rtol=1e-6)
    assert not torch.equal(p, randn(gen(20), n))  # it moved


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_fused_adamw_equals_torch_adamw_on_a_model(weight_decay):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(10, 33), torch.nn.Tanh(), torch.nn.Linear(33, 3)).to(DEV)
    twin = copy.deepcopy(model)
    fused = K.FusedAdamW(model, lr=1e-2, betas=(0.85, 0.98), eps=1e-7, weight_decay=weight_decay)
    eager = torch.optim.AdamW(twin.parameters(), lr=1e-2, betas=(0.85, 0.98), eps=1e-7,
                              weight_decay=weight_decay, foreach=False)
    g = gen(21)
    for _ in range(5):
        x = randn(g, 8, 10)
        for net, opt in ((model, fused), (twin, eager)):
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        close(p, q, atol=1e-6)
    offset = 0  # the moments live in one flat buffer, parameter after parameter
    for p, q in zip(model.parameters(), twin.parameters()):
        k = p.numel()
        close(fused.exp_avg[offset:offset + k], eager.state[q]["exp_avg"].reshape(-1), atol=1e-7)
        close(fused.exp_avg_sq[offset:offset + k], eager.state[q]["exp_avg_sq"].reshape(-1), atol=1e-8)
        offset += k


def test_flat_parameters_are_views_that_backward_fills():
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 2)).to(DEV)
    before = [p.detach().clone() for p in model.parameters()]
    flat = K.FlatParameters(model.parameters())
    assert flat.param.numel() == sum(p.numel() for p in model.parameters())
    for p, b in zip(model.parameters(), before):
        torch.testing.assert_close(p.detach(), b)
        assert p.untyped_storage().data_ptr() == flat.param.untyped_storage().data_ptr()
    x = randn(gen(22), 3, 4)
    model(x).sum().backward()
    first = flat.grad.clone()
    assert first.abs().sum() > 0
    model(x).sum().backward()  # accumulates into the same buffer
    close(flat.grad, 2 * first, atol=1e-6)
    flat.param.add_(1.0)  # writes through to the model
    close(next(model.parameters()).detach(), before[0] + 1, atol=0)
    flat.zero_grad()
    assert flat.grad.abs().sum() == 0
    next(model.parameters()).grad = None
    with pytest.raises(RuntimeError, match="no longer a view.*FlatParameters.zero_grad"):
        flat.check_views()


def test_adamw_rejects_bad_input_clearly():
    f = torch.zeros(8, device=DEV)
    with pytest.raises(TypeError, match="fp32.*chapter 08"):
        K.fused_adamw_step(f.half(), f, f, f, step=1)
    with pytest.raises(ValueError, match="flat contiguous 1-D"):
        K.fused_adamw_step(f.view(2, 4), f, f, f, step=1)
    with pytest.raises(ValueError, match="grad has 7 elements"):
        K.fused_adamw_step(f, f[:7], f, f, step=1)
    with pytest.raises(ValueError, match="step counts from 1"):
        K.fused_adamw_step(f, f, f, f, step=0)
    with pytest.raises(ValueError, match="betas"):
        K.FusedAdamW(torch.nn.Linear(2, 2), betas=(0.9, 1.0))
    with pytest.raises(TypeError, match="float16.*fp32"):
        K.FlatParameters(torch.nn.Linear(2, 2).half().parameters())


# --- cross-entropy --------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("shape", random_shapes(30, 3, max_cols=1000))
def test_cross_entropy_equals_reference(shape, reduction):
    M, V = shape
    g = gen(31)
    logits = randn(g, M, V, scale=3.0).requires_grad_()
    targets = torch.randint(0, V, (M,), generator=g).to(DEV)
    targets[1::3] = -100  # ignored rows
    loss = K.cross_entropy(logits, targets, reduction=reduction)
    ref = F.cross_entropy(logits, targets, reduction=reduction)
    close(loss, ref, atol=1e-5)
    close(torch.autograd.grad(loss, logits)[0], torch.autograd.grad(ref, logits)[0], atol=1e-7)


@pytest.mark.parametrize("V", [1, 64, 65, 1000])
def test_cross_entropy_streams_the_vocabulary_in_blocks(V):
    g = gen(32)
    logits = randn(g, 5, V, scale=20.0)
    logits[0, : min(V - 1, 100)] = -float("inf")  # a leading block of only -inf
    targets = torch.randint(0, V, (5,), generator=g).to(DEV)
    targets[0] = V - 1
    loss, grad = K.cross_entropy_forward_backward(logits, targets, block_size=64)
    x = logits.clone().requires_grad_()
    ref = F.cross_entropy(x, targets)
    ref.backward()
    close(loss, ref, atol=1e-5)
    close(grad, x.grad, atol=1e-7)


@pytest.mark.parametrize("dtype, atol", [(torch.float16, 2e-3), (torch.bfloat16, 1e-2)])
def test_cross_entropy_half_precision_logits(dtype, atol):
    g = gen(33)
    logits = randn(g, 6, 300, dtype=dtype, scale=3.0).requires_grad_()
    targets = torch.randint(0, 300, (6,), generator=g).to(DEV)
    loss = K.cross_entropy(logits, targets)
    (grad,) = torch.autograd.grad(loss, logits)
    x = logits.detach().float().requires_grad_()
    ref = F.cross_entropy(x, targets)
    ref.backward()
    assert grad.dtype == dtype
    close(loss, ref, atol=atol)
    close(grad, x.grad, atol=atol)


def test_cross_entropy_batched_logits_ignore_index_and_upstream_scale():
    g = gen(34)
    logits = randn(g, 2, 5, 40, scale=2.0).requires_grad_()
    targets = torch.randint(0, 40, (2, 5), generator=g).to(DEV)
    targets[0, 0] = 7
    loss = K.cross_entropy(logits, targets, ignore_index=7)
    (grad,) = torch.autograd.grad(3.0 * loss, logits)  # backward scales the kept gradient
    x = logits.detach().clone().requires_grad_()
    ref = F.cross_entropy(x.reshape(-1, 40), targets.reshape(-1), ignore_index=7)
    (3.0 * ref).backward()
    close(loss, ref, atol=1e-5)
    close(grad, x.grad, atol=1e-7)
    all_ignored = torch.full((2, 5), -100, device=DEV)
    loss = K.cross_entropy(logits, all_ignored)  # torch: nan loss, zero gradient
    (grad,) = torch.autograd.grad(loss, logits)
    assert torch.isnan(loss) and torch.isnan(F.cross_entropy(logits.reshape(-1, 40), all_ignored.reshape(-1)))
    assert grad.abs().sum() == 0
    no_grad_loss, no_grad = K.cross_entropy_forward_backward(logits.detach(), targets, compute_grad=False)
    close(no_grad_loss, F.cross_entropy(logits.detach().reshape(-1, 40), targets.reshape(-1)), atol=1e-5)
    assert no_grad is None


def test_cross_entropy_rejects_bad_input_clearly():
    logits = torch.zeros(3, 5, device=DEV)
    with pytest.raises(IndexError, match="target 5 is out of bounds for 5 classes"):
        K.cross_entropy(logits, torch.tensor([0, 5, 1], device=DEV))
    with pytest.raises(TypeError, match="integer tensor of class indices"):
        K.cross_entropy(logits, torch.zeros(3, device=DEV))
    with pytest.raises(ValueError, match=r"targets of shape \(4,\).*shape \(3,\)"):
        K.cross_entropy(logits, torch.zeros(4, dtype=torch.long, device=DEV))
    with pytest.raises(ValueError, match="no classes"):
        K.cross_entropy(torch.zeros(3, 0, device=DEV), torch.zeros(3, dtype=torch.long, device=DEV))
    with pytest.raises(ValueError, match="'mean' or 'sum'"):
        K.cross_entropy(logits, torch.zeros(3, dtype=torch.long, device=DEV), reduction="none")


# --- benchmark -----------------------------------------------------------------------------------


def test_bench_eager_sequences_move_what_the_cost_model_counts():
    """The benchmark's "eager" baselines are the op sequences costmodel's eager counts describe, so
    its GB/s sit on the same bytes as the notebook's model."""
    from minitorch_dist.analysis import costmodel
    from minitorch_dist.analysis.meters import ByteCounter
    from minitorch_dist.kernels import bench

    M, N = 6, 37
    x, w, b = torch.randn(M, N), torch.randn(N), torch.randn(N)
    for name, args, want in (("softmax", (x,), costmodel.softmax_bytes(M, N)),
                             ("layernorm", (x, w, b), costmodel.layernorm_bytes(M, N))):
        eager = bench.KERNELS[name][1]["eager"]
        with ByteCounter() as c:
            eager(*args)
        assert {"read": c.read, "written": c.written} == want, name


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on machines without a GPU")
def test_bench_refuses_on_cpu_with_a_clear_message(tmp_path, capsys):
    from minitorch_dist.kernels import bench

    out = tmp_path / "results.json"
    assert bench.main(["--out", str(out), "--smoke"]) == 2
    assert "CUDA GPU" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["softmax", "layernorm"])
def test_fused_kernel_reaches_80_percent_of_copy_bandwidth(kernel):
    from minitorch_dist.kernels import bench

    row = bench.measure(kernel, M=8192, N=8192, dtype=torch.float32, impls=("triton",))
    assert row["triton"] >= 0.8 * row["copy"], row


@pytest.mark.gpu
def test_bench_writes_results_with_the_gpu_name(tmp_path):
    from minitorch_dist.kernels import bench

    out = tmp_path / "results.json"
    assert bench.main(["--out", str(out), "--smoke"]) == 0
    results = json.loads(out.read_text())
    assert results["gpu"] == torch.cuda.get_device_name(0) and results["triton"] and results["torch"]
    for k in ("softmax", "layernorm"):
        rows = results["kernels"][k]
        assert [r["N"] for r in rows] == bench.SMOKE_SIZES
        assert all(r[c] > 0 for r in rows for c in ("eager", "torch", "compile", "triton", "copy"))
