"""CPU Adam: equals torch.optim.AdamW / Adam on every SIMD path, every SIMD path gives the scalar
reference's bits, exact 16-bit copy-out, torch-compatible state dicts, and clear errors that leave every
buffer untouched."""
import pytest
import torch

from zero.ops import builder
from zero.ops.cpu_adam import CPUAdam, simd_levels
from zero.testing.adam import keyword_step

cpu_adam_step = keyword_step(checked=True)
cpu_adam_step_unchecked = keyword_step(checked=False)


LEVELS = simd_levels()  # an op that cannot build must fail here, not skip: CI has a compiler

RTOL = 1e-6  # relative to the tensor's largest magnitude (see assert_close_rel)
SIZES = [1, 7, 1023]
BIG = 2**20 + 3
HALF_DTYPES = [torch.bfloat16, torch.float16]


def assert_close_rel(got: torch.Tensor, want: torch.Tensor, rtol: float = RTOL, msg: str = "") -> None:
    """max |got - want| <= rtol * max |want|: relative error in the max norm. (Element-wise relative
    error is meaningless for parameters that pass through zero during training.)"""
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= rtol * scale, f"{msg}: max abs error {err:.3g} > {rtol:g} * {scale:.3g}"


def reference_adam_step(p, g, m, v, *, step, lr, betas, eps, weight_decay, adamw_mode, bias_correction):
    """torch.optim.Adam's single-tensor step written with the same torch ops, plus a bias_correction
    switch that torch lacks. test_reference_is_torch_optim checks it against torch itself."""
    beta1, beta2 = betas
    if weight_decay != 0:
        if adamw_mode:
            p.mul_(1 - lr * weight_decay)
        else:
            g = g.add(p, alpha=weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bc1 = 1 - beta1**step if bias_correction else 1.0
    bc2 = 1 - beta2**step if bias_correction else 1.0
    denom = (v.sqrt() / bc2**0.5).add_(eps)
    p.addcdiv_(m, denom, value=-lr / bc1)


def run_side_by_side(n, optimizers_for, steps=100, seed=0):
    """Step several optimizers, each on its own copy of the same parameter, with the same gradients.
    `optimizers_for(start)` returns (params, optimizers); returns the final parameters."""
    gen = torch.Generator().manual_seed(seed)
    params, opts = optimizers_for(torch.randn(n, generator=gen))
    for _ in range(steps):
        g = torch.randn(n, generator=gen)
        for p in params:
            p.grad = g.clone()
        for opt in opts:
            opt.step()
    return [p.detach() for p in params]


def cpu_adams_and_torch(start, *, torch_cls, simd_list, **kw):
    """One torch optimizer, then one CPUAdam per forced SIMD level, each on its own copy of start."""
    params = [start.clone().requires_grad_() for _ in range(len(simd_list) + 1)]
    torch_kw = {k: v for k, v in kw.items() if k != "adamw_mode"}
    opts = [torch_cls([params[0]], **torch_kw)]
    opts += [CPUAdam([p], simd=s, **kw) for p, s in zip(params[1:], simd_list)]
    return params, opts


# ----------------------------------------------------------------------------- equivalence with torch


def test_reference_is_torch_optim():
    """The test's own reference (used for bias_correction=False) reproduces torch bit for bit."""
    torch.manual_seed(0)
    for cls, adamw_mode in ((torch.optim.AdamW, True), (torch.optim.Adam, False)):
        p = torch.randn(1000, requires_grad=True)
        q, m, v = p.detach().clone(), torch.zeros(1000), torch.zeros(1000)
        opt = cls([p], lr=1e-2, weight_decay=0.1)
        for step in range(1, 21):
            g = torch.randn(1000)
            p.grad = g.clone()
            opt.step()
            reference_adam_step(q, g, m, v, step=step, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1,
                                adamw_mode=adamw_mode, bias_correction=True)
        assert torch.equal(p.detach(), q)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_cpu_adam_matches_torch_adamw_for_every_simd_path(n, weight_decay):
    got = run_side_by_side(n, lambda s: cpu_adams_and_torch(
        s, torch_cls=torch.optim.AdamW, simd_list=LEVELS, lr=1e-2, weight_decay=weight_decay))
    for simd, p in zip(LEVELS, got[1:]):
        assert_close_rel(p, got[0], msg=simd)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_cpu_adam_with_adamw_mode_off_matches_torch_adam_for_every_simd_path(n, weight_decay):
    got = run_side_by_side(n, lambda s: cpu_adams_and_torch(
        s, torch_cls=torch.optim.Adam, simd_list=LEVELS, lr=1e-2, weight_decay=weight_decay, adamw_mode=False))
    for simd, p in zip(LEVELS, got[1:]):
        assert_close_rel(p, got[0], msg=simd)


def test_cpu_adam_matches_torch_on_a_million_elements_for_every_simd_path():
    """2**20 + 3: many tiles across threads, and a partial last vector."""
    got = run_side_by_side(BIG, lambda s: cpu_adams_and_torch(
        s, torch_cls=torch.optim.AdamW, simd_list=LEVELS, lr=1e-2, weight_decay=0.1))
    for simd, p in zip(LEVELS, got[1:]):
        assert_close_rel(p, got[0], msg=simd)


def test_cpu_adam_matches_torch_adam_on_a_million_elements_with_the_best_simd_path():
    got = run_side_by_side(BIG, lambda s: cpu_adams_and_torch(
        s, torch_cls=torch.optim.Adam, simd_list=LEVELS[:1], lr=1e-2, weight_decay=0.1, adamw_mode=False))
    assert_close_rel(got[1], got[0])


@pytest.mark.parametrize("simd", LEVELS)
@pytest.mark.parametrize("n", [7, 1023])
@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_bias_correction_off_matches_the_reference(simd, n, adamw_mode, weight_decay):
    torch.manual_seed(1)
    kw = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay, adamw_mode=adamw_mode)
    p = torch.randn(n, requires_grad=True)
    q, m, v = p.detach().clone(), torch.zeros(n), torch.zeros(n)
    opt = CPUAdam([p], bias_correction=False, simd=simd, **kw)
    for step in range(1, 101):
        g = torch.randn(n)
        p.grad = g.clone()
        opt.step()
        reference_adam_step(q, g, m, v, step=step, bias_correction=False, **kw)
    assert_close_rel(p.detach(), q)
    assert_close_rel(opt.state[p]["exp_avg_sq"], v)


@pytest.mark.parametrize("simd", LEVELS)
@pytest.mark.parametrize("grad_dtype", HALF_DTYPES)
@pytest.mark.parametrize("n", [7, 1023])
def test_16bit_grads_match_torch_on_the_upcast_grads(simd, grad_dtype, n):
    gen = torch.Generator().manual_seed(2)
    p = torch.randn(n, generator=gen)
    q = p.clone().requires_grad_()
    m, v = torch.zeros(n), torch.zeros(n)
    opt = torch.optim.AdamW([q], lr=1e-2, weight_decay=0.1)
    for step in range(1, 101):
        g16 = torch.randn(n, generator=gen).to(grad_dtype)
        q.grad = g16.float()
        opt.step()
        cpu_adam_step(p, g16, m, v, step=step, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, simd=simd)
    assert_close_rel(p, q.detach())


@pytest.mark.parametrize("simd", LEVELS)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16])
def test_grad_scale_divides_the_gradient_first(simd, grad_dtype):
    gen = torch.Generator().manual_seed(3)
    n, scale = 1023, 1024.0
    p = torch.randn(n, generator=gen)
    q = p.clone().requires_grad_()
    m, v = torch.zeros(n), torch.zeros(n)
    opt = torch.optim.AdamW([q], lr=1e-2, weight_decay=0.1)
    for step in range(1, 51):
        g = (torch.randn(n, generator=gen) * scale).to(grad_dtype)
        q.grad = g.float() / scale
        opt.step()
        cpu_adam_step(p, g, m, v, step=step, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1,
                      grad_scale=scale, simd=simd)
    assert_close_rel(p, q.detach())


def test_results_do_not_depend_on_the_thread_count():
    gen = torch.Generator().manual_seed(4)
    n = 3 * 16384 + 5
    bufs = {t: [torch.randn(n, generator=torch.Generator().manual_seed(5)), torch.zeros(n), torch.zeros(n)]
            for t in (1, 2)}
    for step in range(1, 4):
        g = torch.randn(n, generator=gen)
        for t, (p, m, v) in bufs.items():
            cpu_adam_step(p, g, m, v, step=step, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1,
                          num_threads=t)
    for a, b in zip(bufs[1], bufs[2]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("simd", LEVELS)
def test_empty_buffers_are_a_no_op(simd):
    """n = 0 (torch hands the kernel null data pointers): the step succeeds and leaves the buffers
    empty, the kernel still refuses a bad hyperparameter, and CPUAdam counts the step as
    torch.optim.AdamW does, beside a non-empty parameter that it updates as torch does."""
    p, g, m, v = (torch.zeros(0) for _ in range(4))
    out = torch.zeros(0, dtype=torch.bfloat16)
    kw = dict(step=1, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, out16=out, simd=simd)
    cpu_adam_step(p, g, m, v, **kw)
    assert all(t.shape == (0,) for t in (p, g, m, v, out))
    with pytest.raises(RuntimeError, match="zero_cpu_adam_step rejected its arguments"):
        cpu_adam_step_unchecked(p, g, m, v, **{**kw, "lr": float("nan")})  # checked before n == 0 returns

    gen = torch.Generator().manual_seed(5)
    start = torch.randn(7, generator=gen)
    ours = [torch.zeros(0, requires_grad=True), start.clone().requires_grad_()]
    theirs = [torch.zeros(0, requires_grad=True), start.clone().requires_grad_()]
    opts = [CPUAdam(ours, lr=1e-2, weight_decay=0.1, simd=simd), torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1)]
    for _ in range(3):
        grad = torch.randn(7, generator=gen)
        for params, opt in zip((ours, theirs), opts):
            params[0].grad, params[1].grad = torch.zeros(0), grad.clone()
            opt.step()
    ours_state, theirs_state = (opt.state_dict()["state"] for opt in opts)
    assert ours_state[0]["step"].item() == theirs_state[0]["step"].item() == 3
    assert ours_state[0]["exp_avg"].shape == ours[0].shape == (0,)
    assert_close_rel(ours[1].detach(), theirs[1].detach(), msg=simd)


def test_simd_levels_are_listed_best_first_and_end_with_scalar():
    assert LEVELS[-1] == "scalar"
    order = ["avx512", "avx2", "scalar"]
    assert LEVELS == sorted(LEVELS, key=order.index)


@pytest.mark.parametrize("grad_dtype", [torch.float32] + HALF_DTYPES)
@pytest.mark.parametrize("out_dtype", [None] + HALF_DTYPES)
@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("grad_scale", [1.0, 3.0])
def test_every_simd_path_gives_the_scalar_reference_bits(grad_dtype, out_dtype, adamw_mode, grad_scale):
    """The SIMD paths perform the scalar path's operations in its order ([Note: adam math]), so
    they agree bit for bit: over several tiles, a partial last vector, both decay modes, an
    unscaled and a scaled gradient, and every grad / copy-out dtype."""
    n = 2 * 16384 + 37
    gen = torch.Generator().manual_seed(14)
    start = [torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 0.1, torch.rand(n, generator=gen) * 0.01]
    grads = [(torch.randn(n, generator=gen) * grad_scale).to(grad_dtype) for _ in range(5)]
    results = {}
    for simd in LEVELS:
        p, m, v = (t.clone() for t in start)
        out = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
        for step, g in enumerate(grads, 1):
            cpu_adam_step(p, g, m, v, step=step, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1,
                          adamw_mode=adamw_mode, grad_scale=grad_scale, out16=out, simd=simd)
        results[simd] = [t.view(torch.int32) for t in (p, m, v)] + ([] if out is None else [out.view(torch.int16)])
    for simd in LEVELS:
        for name, got, want in zip(("param", "exp_avg", "exp_avg_sq", "out16"), results[simd], results["scalar"]):
            assert torch.equal(got, want), f"{simd}: {name} differs from the scalar path"


# ----------------------------------------------------------------------------- unchecked entry point


def test_unchecked_step_gives_the_checked_bits_and_bumps_autograd_versions():
    gen = torch.Generator().manual_seed(15)
    start = [torch.randn(1000, generator=gen), torch.zeros(1000), torch.zeros(1000)]
    g = torch.randn(1000, generator=gen).bfloat16()
    kw = dict(step=1, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, grad_scale=2.0)
    checked = [t.clone() for t in start] + [torch.empty(1000, dtype=torch.float16)]
    unchecked = [t.clone() for t in start] + [torch.empty(1000, dtype=torch.float16)]
    cpu_adam_step(checked[0], g, checked[1], checked[2], out16=checked[3], **kw)
    versions = [t._version for t in unchecked]
    cpu_adam_step_unchecked(unchecked[0], g, unchecked[1], unchecked[2], out16=unchecked[3], **kw)
    for a, b in zip(checked, unchecked):
        assert torch.equal(a, b)
    assert all(t._version > v for t, v in zip(unchecked, versions))


def test_unchecked_step_raises_a_remembered_build_failure_without_building(monkeypatch):
    failure = builder.OpUnavailable("op 'cpu_adam' failed to build: (a test's stand-in)")
    monkeypatch.setattr(builder, "_loaded", {})
    monkeypatch.setattr(builder, "_failed", {"cpu_adam": failure})
    monkeypatch.setattr(builder, "_build", lambda name: pytest.fail("a failed op was built again"))
    p, g, m, v = (torch.zeros(8) for _ in range(4))
    for _ in range(2):
        with pytest.raises(builder.OpUnavailable, match="stand-in"):
            cpu_adam_step_unchecked(p, g, m, v, step=1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)


# ----------------------------------------------------------------------------- 16-bit copy-out


def rounding_cases() -> torch.Tensor:
    """fp32 values that stress rounding to bf16 and fp16: exact ties both ways, the fp16 overflow
    edge, fp16 subnormals, infinities, signed zeros, and random bit patterns (finite only)."""
    edges = [0.0, -0.0, 1.0, -1.0, 65504.0, 65519.0, 65520.0, 65536.0, 1e-8, 6e-8, 3e-8, 5.96e-8, 6.1e-5, 1e38,
             3.4e38, float("inf"), float("-inf"), 1.00390625, 1.01171875, 1.001953125, 1.0029296875, 2.0**-24,
             2.0**-25, 3 * 2.0**-26, 2.0**-149]
    bits = torch.randint(-(2**31), 2**31 - 1, (20000,), dtype=torch.int64,
                         generator=torch.Generator().manual_seed(6)).to(torch.int32).view(torch.float32)
    bits = bits[torch.isfinite(bits)]
    return torch.cat([torch.tensor(edges), bits, torch.randn(5000) * 1e4, torch.randn(5000) * 1e-5])


@pytest.mark.parametrize("simd", LEVELS)
@pytest.mark.parametrize("out_dtype", HALF_DTYPES)
def test_copy_out_rounds_exactly_like_torch_to_on_special_values(simd, out_dtype):
    """With lr = 0 the step leaves param as it is, so the copy-out is a pure fp32 -> 16-bit cast."""
    for start in (0, 3):  # unaligned copy-out buffers take the ordinary-store path
        x = rounding_cases()[start:]
        p, g, m, v = x.clone(), torch.ones_like(x), torch.zeros_like(x), torch.zeros_like(x)
        out = torch.empty(x.numel() + 8, dtype=out_dtype)[start:start + x.numel()]
        cpu_adam_step(p, g, m, v, step=1, lr=0.0, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, out16=out,
                      simd=simd)
        assert torch.equal(p.view(torch.int32), x.view(torch.int32))
        assert torch.equal(out.view(torch.int16), x.to(out_dtype).view(torch.int16))


@pytest.mark.parametrize("simd", LEVELS)
@pytest.mark.parametrize("out_dtype", HALF_DTYPES)
def test_copy_out_keeps_nan_a_nan(simd, out_dtype):
    x = torch.tensor([float("nan"), 1.0] * 20)
    p, g, m, v = x.clone(), torch.ones_like(x), torch.zeros_like(x), torch.zeros_like(x)
    out = torch.zeros(x.numel(), dtype=out_dtype)
    cpu_adam_step(p, g, m, v, step=1, lr=0.0, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, out16=out, simd=simd)
    assert torch.equal(torch.isnan(out), torch.isnan(x))


@pytest.mark.parametrize("simd", LEVELS)
@pytest.mark.parametrize("out_dtype", HALF_DTYPES)
@pytest.mark.parametrize("n", SIZES + [BIG])
def test_copy_out_equals_rounding_the_updated_fp32_param(simd, out_dtype, n):
    gen = torch.Generator().manual_seed(7)
    p, m, v = torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=out_dtype)
    for step in range(1, 4):
        g = torch.randn(n, generator=gen)
        cpu_adam_step(p, g, m, v, step=step, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, out16=out,
                      simd=simd)
        assert torch.equal(out.view(torch.int16), p.to(out_dtype).view(torch.int16))


def test_optimizer_copy_out_writes_each_parameter_in_order():
    torch.manual_seed(8)
    params = [torch.randn(5, 3, requires_grad=True), torch.randn(4, requires_grad=True),
              torch.randn(100, requires_grad=True)]
    opt = CPUAdam([{"params": params[:2]}, {"params": params[2:], "lr": 1e-2}])
    outs = [torch.zeros(15, dtype=torch.bfloat16), None, torch.zeros(100, dtype=torch.float16)]
    untouched = torch.zeros(4, dtype=torch.bfloat16)
    params[1].grad = None  # no gradient: skipped, and so is its entry
    params[0].grad, params[2].grad = torch.randn(5, 3), torch.randn(100)
    outs_with_unused = [outs[0], untouched, outs[2]]
    opt.step(out16=outs_with_unused)
    assert torch.equal(outs[0], params[0].detach().reshape(-1).to(torch.bfloat16))
    assert torch.equal(outs[2], params[2].detach().to(torch.float16))
    assert torch.equal(untouched, torch.zeros(4, dtype=torch.bfloat16))


def test_non_contiguous_gradients_are_accepted_by_the_optimizer():
    torch.manual_seed(9)
    p = torch.randn(6, 5, requires_grad=True)
    q = p.detach().clone().requires_grad_()
    mine, ref = CPUAdam([p], lr=1e-2, weight_decay=0.01), torch.optim.AdamW([q], lr=1e-2, weight_decay=0.01)
    for _ in range(5):
        g = torch.randn(5, 6).t()  # a transposed view
        p.grad, q.grad = g, g.contiguous()
        mine.step()
        ref.step()
    assert_close_rel(p.detach(), q.detach())


# ----------------------------------------------------------------------------- state dicts


def _grads(n_steps, shapes, seed):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen) for s in shapes] for _ in range(n_steps)]


def _train(opt, params, grads):
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()


@pytest.mark.parametrize("first_is_ours", [True, False])
def test_state_dict_moves_between_cpu_adam_and_torch_adamw_and_training_continues(first_is_ours):
    shapes = [(7, 3), (1023,)]
    kw = dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.05)
    make = [lambda ps: CPUAdam(ps, **kw), lambda ps: torch.optim.AdamW(ps, **kw)]
    if not first_is_ours:
        make.reverse()
    init = [torch.randn(s, generator=torch.Generator().manual_seed(10)) for s in shapes]
    grads = _grads(20, shapes, seed=11)

    # the reference: 20 steps of plain torch AdamW
    ref_params = [t.clone().requires_grad_() for t in init]
    _train(torch.optim.AdamW(ref_params, **kw), ref_params, grads)

    # 10 steps with the first optimizer, hand over the state dict, 10 more with the second
    a_params = [t.clone().requires_grad_() for t in init]
    a = make[0](a_params)
    _train(a, a_params, grads[:10])
    saved = a.state_dict()
    assert set(saved["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert saved["state"][0]["step"].dtype == torch.float32 and saved["state"][0]["step"].dim() == 0
    assert saved["state"][0]["step"].item() == 10.0
    b_params = [p.detach().clone().requires_grad_() for p in a_params]
    b = make[1](b_params)
    b.load_state_dict(saved)
    _train(b, b_params, grads[10:])

    for got, want in zip(b_params, ref_params):
        assert_close_rel(got.detach(), want.detach())
    assert b.state_dict()["state"][1]["step"].item() == 20.0


def test_loading_torch_adam_state_keeps_l2_weight_decay():
    shapes = [(50,)]
    init = [torch.randn(50)]
    grads = _grads(10, shapes, seed=12)
    ref = [init[0].clone().requires_grad_()]
    _train(torch.optim.Adam(ref, lr=1e-2, weight_decay=0.1), ref, grads)
    a = [init[0].clone().requires_grad_()]
    torch_adam = torch.optim.Adam(a, lr=1e-2, weight_decay=0.1)
    _train(torch_adam, a, grads[:5])
    b = [a[0].detach().clone().requires_grad_()]
    ours = CPUAdam(b, lr=1.0)  # adamw_mode=True and lr=1 here are overwritten by the loaded groups
    ours.load_state_dict(torch_adam.state_dict())
    assert ours.param_groups[0]["adamw_mode"] is False and ours.param_groups[0]["lr"] == 1e-2
    _train(ours, b, grads[5:])
    assert_close_rel(b[0].detach(), ref[0].detach())


def test_loading_an_amsgrad_state_dict_is_refused():
    p = torch.randn(3, requires_grad=True)
    theirs = torch.optim.AdamW([p], amsgrad=True)
    with pytest.raises(ValueError, match="amsgrad"):
        CPUAdam([torch.randn(3, requires_grad=True)]).load_state_dict(theirs.state_dict())


# ----------------------------------------------------------------------------- bad input


def _good_args(n=64):
    gen = torch.Generator().manual_seed(13)
    return dict(param=torch.randn(n, generator=gen), grad=torch.randn(n, generator=gen),
                exp_avg=torch.randn(n, generator=gen), exp_avg_sq=torch.rand(n, generator=gen),
                out16=torch.zeros(n, dtype=torch.bfloat16), step=3, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                weight_decay=0.01)


BAD_CALLS = {
    "fp16 param": ("param", lambda a: a.update(param=a["param"].half())),
    "int grad": ("grad", lambda a: a.update(grad=a["grad"].to(torch.int32))),
    "fp64 grad": ("grad", lambda a: a.update(grad=a["grad"].double())),
    "bf16 exp_avg": ("exp_avg", lambda a: a.update(exp_avg=a["exp_avg"].bfloat16())),
    "fp16 exp_avg_sq": ("exp_avg_sq", lambda a: a.update(exp_avg_sq=a["exp_avg_sq"].half())),
    "short grad": ("grad", lambda a: a.update(grad=a["grad"][:-1])),
    "long exp_avg": ("exp_avg", lambda a: a.update(exp_avg=torch.zeros(65))),
    "short exp_avg_sq": ("exp_avg_sq", lambda a: a.update(exp_avg_sq=a["exp_avg_sq"][:10])),
    "strided param": ("param", lambda a: a.update(param=torch.zeros(128)[::2])),
    "strided grad": ("grad", lambda a: a.update(grad=torch.zeros(128)[::2])),
    "strided exp_avg": ("exp_avg", lambda a: a.update(exp_avg=torch.zeros(128)[::2])),
    "grad not a tensor": ("grad", lambda a: a.update(grad=[0.0] * 64)),
    "negative lr": ("lr", lambda a: a.update(lr=-1e-3)),
    "nan lr": ("lr", lambda a: a.update(lr=float("nan"))),
    "beta1 = 1": (r"betas\[0\]", lambda a: a.update(betas=(1.0, 0.999))),
    "negative beta2": (r"betas\[1\]", lambda a: a.update(betas=(0.9, -0.1))),
    "one beta": ("betas", lambda a: a.update(betas=(0.9,))),
    "negative eps": ("eps", lambda a: a.update(eps=-1.0)),
    "negative weight_decay": ("weight_decay", lambda a: a.update(weight_decay=-0.1)),
    "step 0": ("step", lambda a: a.update(step=0)),
    "float step": ("step", lambda a: a.update(step=1.5)),
    "zero grad_scale": ("grad_scale", lambda a: a.update(grad_scale=0.0)),
    "inf grad_scale": ("grad_scale", lambda a: a.update(grad_scale=float("inf"))),
    "fp32 out16": ("out16", lambda a: a.update(out16=torch.zeros(64))),
    "short out16": ("out16", lambda a: a.update(out16=torch.zeros(63, dtype=torch.float16))),
    "strided out16": ("out16", lambda a: a.update(out16=torch.zeros(128, dtype=torch.float16)[::2])),
    "unknown simd": ("simd", lambda a: a.update(simd="sse9")),
    "float num_threads": ("num_threads", lambda a: a.update(num_threads=1.5)),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_input_is_a_value_error_naming_it_and_touches_nothing(case):
    name, spoil = BAD_CALLS[case]
    args = _good_args()
    spoil(args)
    given = {k: v for k, v in args.items() if isinstance(v, torch.Tensor)}
    before = {k: v.clone() for k, v in given.items()}
    kwargs = dict(args)
    with pytest.raises(ValueError, match=name):
        cpu_adam_step(kwargs.pop("param"), kwargs.pop("grad"), kwargs.pop("exp_avg"), kwargs.pop("exp_avg_sq"),
                      **kwargs)
    for k, v in given.items():
        assert torch.equal(v, before[k]), f"{k} was modified by a rejected call"


def test_rejected_call_leaves_the_very_buffers_it_was_given_unchanged():
    args = _good_args()
    originals = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
    bad_out = torch.zeros(64, dtype=torch.float32)
    tensors = (args["param"], args["grad"], args["exp_avg"], args["exp_avg_sq"])
    with pytest.raises(ValueError, match="out16"):
        cpu_adam_step(*tensors, step=3, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, out16=bad_out)
    with pytest.raises(ValueError, match="lr"):
        cpu_adam_step(*tensors, step=3, lr=-1.0, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, out16=args["out16"])
    for k, v in originals.items():
        assert torch.equal(args[k], v), k
    assert torch.equal(bad_out, torch.zeros(64))


def test_optimizer_rejects_non_fp32_or_non_cpu_params_naming_them():
    good = torch.randn(3, requires_grad=True)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\].*float16"):
        CPUAdam([good, torch.randn(3).half().requires_grad_()])
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[0\]"):
        CPUAdam([{"params": [good]}, {"params": [torch.randn(3, dtype=torch.float64)]}])
    with pytest.raises(ValueError, match="contiguous"):
        CPUAdam([torch.randn(4, 4).t()])


@pytest.mark.parametrize("kwargs,name", [
    (dict(lr=-1.0), "lr"), (dict(betas=(0.9, 1.0)), r"betas\[1\]"), (dict(eps=-1e-8), "eps"),
    (dict(weight_decay=-1.0), "weight_decay"), (dict(amsgrad=True), "amsgrad"), (dict(simd="neon"), "simd"),
])
def test_optimizer_rejects_bad_hyperparameters(kwargs, name):
    with pytest.raises(ValueError, match=name):
        CPUAdam([torch.randn(3, requires_grad=True)], **kwargs)


def test_optimizer_rejects_a_bad_group_hyperparameter_naming_the_group():
    with pytest.raises(ValueError, match=r"param_groups\[1\]: lr"):
        CPUAdam([{"params": [torch.randn(2)]}, {"params": [torch.randn(2)], "lr": -1.0}])


@pytest.mark.parametrize("spoil,name", [
    (lambda ps, outs: outs.pop(), "out16 has 1 entries"),
    (lambda ps, outs: outs.__setitem__(1, torch.zeros(5)), r"out16\[1\]"),
    (lambda ps, outs: outs.__setitem__(1, torch.zeros(4, dtype=torch.float16)), r"out16\[1\].*4 elements"),
    (lambda ps, outs: setattr(ps[1], "data", ps[1].data.half()), r"param_groups\[0\]\['params'\]\[1\]"),
    (lambda ps, outs: setattr(ps[1].grad, "data", torch.zeros(5, dtype=torch.float64)), r"\['params'\]\[1\]\.grad"),
    (lambda ps, outs: setattr(ps[1], "grad", torch.zeros(5).to_sparse()), "sparse"),
])
def test_optimizer_step_rejects_bad_input_before_updating_any_parameter(spoil, name):
    params = [torch.randn(3, requires_grad=True), torch.randn(5, requires_grad=True)]
    opt = CPUAdam(params, lr=0.1)
    for p in params:
        p.grad = torch.randn(p.shape)
    outs = [torch.zeros(3, dtype=torch.bfloat16), torch.zeros(5, dtype=torch.bfloat16)]
    spoil(params, outs)
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match=name):
        opt.step(out16=outs)
    for p, b in zip(params, before):
        assert torch.equal(p.detach(), b)
    assert len(opt.state) == 0  # no state was created either
    assert all(torch.equal(o, torch.zeros_like(o)) for o in outs)


# ----------------------------------------------------------------------------- portable build


SCALAR_ONLY_PROGRAM = r"""
#include <stdio.h>
#include "adam/cpu_adam.h"
#include "common/dtypes.h"
#include "common/simd.h"
#include "onebit/onebit.h"
int main(void) {
    float p[37], g[37], m[37] = {0}, v[37] = {0}, scale;
    uint16_t out[37];
    uint8_t bits[5];
    for (int i = 0; i < 37; i++) { p[i] = (float)i / 8 - 2; g[i] = (float)(i % 5) - 2; }
    zero_adam_config cfg = {1e-2, 0.9, 0.999, 1e-8, 0.1, 1.0, 1, 1, 1};
    int forced = zero_cpu_adam_step(37, p, g, ZERO_F32, m, v, NULL, 0, &cfg, ZERO_SIMD_AVX512, 1);
    int best = zero_cpu_adam_step(37, p, g, ZERO_F32, m, v, out, ZERO_BF16, &cfg, ZERO_SIMD_BEST, 2);
    int bad_dtype = zero_cpu_adam_step(37, p, g, ZERO_BYTES, m, v, NULL, 0, &cfg, ZERO_SIMD_BEST, 1);
    int onebit_forced = zero_onebit_pack(37, g, m, 64, bits, &scale, ZERO_SIMD_AVX2, 1);
    printf("%d %d %d %d %d %d %s %d\n", zero_simd_available(ZERO_SIMD_AVX2), zero_simd_available(ZERO_SIMD_AVX512),
           forced, best, bad_dtype, out[36] == zero_f32_to_bf16(p[36]), zero_simd_name(zero_simd_best()),
           onebit_forced);
    return 0;
}
"""


def test_scalar_only_build_runs_and_refuses_forced_simd_levels(tmp_path):
    """What an ARM build gets: only the portable paths, and a clear error code when a SIMD level is
    forced. Built here with -DZERO_NO_X86_SIMD, which compiles every CPU kernel and the shared
    detection (common/simd.c) without their x86 paths."""
    import subprocess

    from zero.ops.builder import OPS, c_compiler, source_dir

    cc = c_compiler()
    assert cc is not None, "no C compiler: zero's CPU ops cannot be built on this machine"
    (tmp_path / "main.c").write_text(SCALAR_ONLY_PROGRAM)
    exe = tmp_path / "scalar_only"
    src = source_dir()
    c_sources = sorted({s for spec in OPS.values() for s in spec.c_sources})
    assert "common/simd.c" in c_sources and "adam/cpu_adam.c" in c_sources, c_sources
    cmd = [cc, "-std=c11", "-O2", "-Wall", "-Werror", "-Wno-unknown-pragmas", "-DZERO_NO_X86_SIMD", "-I", str(src),
           *(str(src / s) for s in c_sources), str(tmp_path / "main.c"), "-lm", "-o", str(exe)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()
    # no AVX2, no AVX-512, forced AVX-512 -> -2 (unavailable), best -> 0 (ok), unknown dtype -> -1,
    # and the 1-bit kernel refuses a forced level with the same code
    assert out == ["0", "0", "-2", "0", "-1", "1", "scalar", "-2"]
