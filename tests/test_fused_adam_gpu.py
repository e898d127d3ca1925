"""FusedAdam computes what torch.optim.AdamW / Adam compute, on the GPU, in one fused launch, and
exactly what the CPU kernel computes ([Note: adam math] in csrc/adam/adam_math.h).

The argument checks run before anything touches CUDA, so those tests run on any machine; the
numerical ones need a GPU and are skipped without one.
"""
import io

import pytest
import torch

import zero.ops.adam as adam_module
import zero.ops.fused_adam as fused_adam_module
from zero.ops import builder
from zero.ops.adam import AdamArgs
from zero.ops.fused_adam import FusedAdam
from zero.testing.adam import keyword_step

cpu_adam_step = keyword_step(checked=True)
fused_adam_step = keyword_step(checked=True)
fused_adam_step_unchecked = keyword_step(checked=False)


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Sizes chosen to hit every path of the kernel: < 4 elements (scalar tail only), not a multiple
# of 4, more than one 16384-element chunk, an empty tensor, and a 2-D one.
SHAPES = [(1,), (3,), (5, 7), (1000,), (2 * 16384 + 5,), (0,), (64, 33)]
HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
STEPS = 100


def _initial_params(shapes=SHAPES, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).cuda() for s in shapes]


def _grads(step, shapes=SHAPES, dtype=torch.float32):
    """The gradients of step `step` (deterministic), rounded to `dtype` on the GPU."""
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=gen).cuda().to(dtype) for s in shapes]


def _torch_optimizer(params, adamw_mode, **hp):
    return (torch.optim.AdamW if adamw_mode else torch.optim.Adam)(params, **hp)


def _assert_params_close(ours, ref):
    for i, (a, b) in enumerate(zip(ours, ref)):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7, msg=lambda m, i=i: f"param {i}: {m}")


# ----------------------------------------------------------------------------- equivalence with torch


@needs_gpu
@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam_l2"])
def test_fused_adam_matches_torch_after_100_steps(adamw_mode):
    init = _initial_params()
    ours = [p.clone().requires_grad_() for p in init]
    ref = [p.clone().requires_grad_() for p in init]
    opt = FusedAdam(ours, adamw_mode=adamw_mode, **HP)
    ref_opt = _torch_optimizer(ref, adamw_mode, **HP)
    for step in range(STEPS):
        for a, b, g in zip(ours, ref, _grads(step)):
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    _assert_params_close(ours, ref)
    for a, b in zip(ours, ref):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[a][key], ref_opt.state[b][key], rtol=1e-5, atol=1e-7)
        assert opt.state[a]["step"].item() == STEPS


@needs_gpu
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_16bit_grads_match_torch_and_copy_out_is_the_rounded_fp32_result(grad_dtype, out_dtype):
    init = _initial_params()
    params = [p.clone() for p in init]
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    out16 = [torch.full(p.shape, float("nan"), dtype=out_dtype, device="cuda") for p in params]
    ref = [p.clone().requires_grad_() for p in init]
    ref_opt = torch.optim.AdamW(ref, **HP)
    for step in range(1, STEPS + 1):
        grads = _grads(step, dtype=grad_dtype)
        fused_adam_step(params, grads, exp_avgs, exp_avg_sqs, step=step, out16=out16, **HP)
        for b, g in zip(ref, grads):
            b.grad = g.float()  # the fp16/bf16 -> fp32 widening is exact
        ref_opt.step()
        for i, (p, o) in enumerate(zip(params, out16)):
            assert torch.equal(o, p.to(out_dtype)), f"step {step}: out16[{i}] differs from params[{i}].to({out_dtype})"
    _assert_params_close(params, ref)


@needs_gpu
def test_grad_scale_divides_the_gradient_first():
    # A power-of-two scale divides exactly, so scaled grads with grad_scale give identical bits.
    scale = 1024.0
    runs = []
    for s in (1.0, scale):
        params = _initial_params()
        exp_avgs = [torch.zeros_like(p) for p in params]
        exp_avg_sqs = [torch.zeros_like(p) for p in params]
        for step in range(1, 11):
            grads = [g * s for g in _grads(step)]
            fused_adam_step(params, grads, exp_avgs, exp_avg_sqs, step=step, grad_scale=s, **HP)
        runs.append(params)
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def _reference_adam_without_bias_correction(p, g, m, v, *, lr, betas, eps, weight_decay):
    """torch.optim.AdamW's single-tensor ops ([Note: adam math]) with bc1 = bc2 = 1."""
    b1, b2 = betas
    p.mul_(1 - lr * weight_decay)
    m.lerp_(g, 1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    p.addcdiv_(m, v.sqrt().add_(eps), value=-lr)


@needs_gpu
def test_without_bias_correction_matches_the_plain_formula():
    params = _initial_params()
    ref = [p.clone() for p in params]
    state = [[torch.zeros_like(p) for p in params] for _ in range(2)]
    ref_state = [[torch.zeros_like(p) for p in params] for _ in range(2)]
    for step in range(1, 21):
        grads = _grads(step)
        fused_adam_step(params, grads, *state, step=step, bias_correction=False, **HP)
        for p, g, m, v in zip(ref, grads, *ref_state):
            _reference_adam_without_bias_correction(p, g, m, v, **HP)
    _assert_params_close(params, ref)


@needs_gpu
def test_long_lists_and_misaligned_views_match_torch():
    # 150 tensors need several launches (64 per table); views at odd offsets of one flat buffer
    # are contiguous but not 16-byte aligned, so they take the element-by-element path.
    shapes = [(1 + (7 * i) % 300,) for i in range(150)]
    total = sum(s[0] for s in shapes)
    flat = torch.randn(total + 1, generator=torch.Generator().manual_seed(3)).cuda()
    params, at = [], 1
    for (n,) in shapes:
        params.append(flat[at:at + n])
        at += n
    ref = [p.clone().requires_grad_() for p in params]
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    ref_opt = torch.optim.AdamW(ref, **HP)
    for step in range(1, 21):
        grads = _grads(step, shapes)
        fused_adam_step(params, grads, exp_avgs, exp_avg_sqs, step=step, **HP)
        for b, g in zip(ref, grads):
            b.grad = g.clone()
        ref_opt.step()
    _assert_params_close(params, ref)


@needs_gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_copy_out_and_grads_at_odd_offsets_beside_aligned_fp32_buffers(out_dtype):
    """Aligned fp32 params and moments keep the four-wide path when the gradient and the 16-bit
    copy sit at odd offsets (a stage-3 group range of a shard): those two are read and written
    element by element inside it. The results are the same either way."""
    shapes = [(4 * 16384 + 6,), (1001,)]
    params = _initial_params(shapes)
    ref = [p.clone().requires_grad_() for p in params]
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    flat16 = torch.empty(sum(p.numel() for p in params) + 1, dtype=out_dtype, device="cuda")
    out16 = [flat16[1:1 + params[0].numel()], flat16[1 + params[0].numel():]]
    ref_opt = torch.optim.AdamW(ref, **HP)
    for step in range(1, 11):
        grads = _grads(step, shapes)
        flat_g = torch.cat([torch.zeros(1, device="cuda")] + grads)
        odd_grads = [flat_g[1:1 + shapes[0][0]], flat_g[1 + shapes[0][0]:]]
        fused_adam_step(params, odd_grads, exp_avgs, exp_avg_sqs, step=step, out16=out16, **HP)
        for b, g in zip(ref, grads):
            b.grad = g.clone()
        ref_opt.step()
        for i, (p, o) in enumerate(zip(params, out16)):
            assert torch.equal(o, p.to(out_dtype)), f"step {step}: out16[{i}] differs from params[{i}].to({out_dtype})"
    _assert_params_close(params, ref)


@needs_gpu
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam_l2"])
def test_fused_adam_gives_the_cpu_kernels_bits(grad_dtype, out_dtype, adamw_mode):
    """One formula for both devices: the CUDA kernel and the CPU kernel's scalar reference call the
    same zero_adam_element with the same step constants, so they agree bit for bit."""
    kw = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, adamw_mode=adamw_mode, grad_scale=4.0)
    init = _initial_params()
    cuda = [[p.clone() for p in init], [torch.zeros_like(p) for p in init], [torch.zeros_like(p) for p in init]]
    cpu = [[t.cpu() for t in ts] for ts in cuda]
    outs = None if out_dtype is None else [torch.empty(p.shape, dtype=out_dtype, device="cuda") for p in init]
    cpu_outs = None if out_dtype is None else [o.cpu() for o in outs]
    for step in range(1, 11):
        grads = [(g * 4.0).to(grad_dtype) for g in _grads(step)]
        fused_adam_step(*cuda, step=step, out16=outs, **kw)
        for i, g in enumerate(grads):
            cpu_adam_step(cpu[0][i], g.cpu(), cpu[1][i], cpu[2][i], step=step, simd="scalar",
                          out16=None if cpu_outs is None else cpu_outs[i], **kw)  # fmt: skip
    for name, on_gpu, on_cpu in zip(("param", "exp_avg", "exp_avg_sq", "out16"), cuda + [outs], cpu + [cpu_outs]):
        for i, (a, b) in enumerate(zip(on_gpu or [], on_cpu or [])):
            assert torch.equal(a.cpu(), b), f"{name}[{i}] differs between the GPU and the CPU kernel"


@needs_gpu
def test_unchecked_step_gives_the_checked_bits_and_bumps_autograd_versions():
    init = _initial_params()
    runs = []
    for step_fn in (fused_adam_step, fused_adam_step_unchecked):
        params = [p.clone() for p in init]
        exp_avgs = [torch.zeros_like(p) for p in params]
        exp_avg_sqs = [torch.zeros_like(p) for p in params]
        out16 = [torch.empty(p.shape, dtype=torch.bfloat16, device="cuda") for p in params]
        versions = [t._version for t in params + exp_avgs + out16 if t.numel()]
        step_fn(params, _grads(1), exp_avgs, exp_avg_sqs, step=1, out16=out16, **HP)
        assert all(t._version > v for t, v in zip([t for t in params + exp_avgs + out16 if t.numel()], versions))
        runs.append(params + exp_avgs + exp_avg_sqs + out16)
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_unchecked_step_raises_a_remembered_build_failure_without_building(monkeypatch):
    failures = {name: builder.OpUnavailable(f"op {name!r} failed to build: (a test's stand-in)")
                for name in ("fused_adam", "cpu_adam")}
    monkeypatch.setattr(builder, "_loaded", {})
    monkeypatch.setattr(builder, "_failed", failures)
    monkeypatch.setattr(builder, "_build", lambda name: pytest.fail("a failed op was built again"))
    params, grads, exp_avgs, exp_avg_sqs = _cpu_lists()
    for _ in range(2):
        # The CUDA launch (what adam_step calls for CUDA tensors) and the CPU entry point.
        with pytest.raises(builder.OpUnavailable, match="'fused_adam'.*stand-in"):
            fused_adam_module.launch(params, grads, exp_avgs, exp_avg_sqs, [None] * 2, AdamArgs(step=1, **HP))
        with pytest.raises(builder.OpUnavailable, match="'cpu_adam'.*stand-in"):
            fused_adam_step_unchecked(params, grads, exp_avgs, exp_avg_sqs, step=1, **HP)


@needs_gpu
def test_params_without_grad_are_skipped_and_keep_their_own_step_count():
    init = _initial_params(shapes=[(10,), (20,)])
    ours = [p.clone().requires_grad_() for p in init]
    ref = [p.clone().requires_grad_() for p in init]
    opt = FusedAdam(ours, **HP)
    ref_opt = torch.optim.AdamW(ref, **HP)
    for step in range(10):
        grads = _grads(step, shapes=[(10,), (20,)])
        for i in range(2):
            g = grads[i] if (i == 0 or step >= 4) else None  # param 1 joins at step 5
            ours[i].grad = None if g is None else g.clone()
            ref[i].grad = None if g is None else g.clone()
        opt.step()
        ref_opt.step()
    assert [opt.state[p]["step"].item() for p in ours] == [10, 6]
    _assert_params_close(ours, ref)


@needs_gpu
def test_optimizer_copy_out_and_closure():
    params = [p.requires_grad_() for p in _initial_params(shapes=[(100,), (7,)])]
    opt = FusedAdam(params, **HP)
    out = torch.zeros(100, dtype=torch.bfloat16, device="cuda")
    for p, g in zip(params, _grads(0, shapes=[(100,), (7,)])):
        p.grad = g
    loss = opt.step(lambda: 42.0, out16=[out, None])
    assert loss == 42.0
    assert torch.equal(out, params[0].detach().to(torch.bfloat16))


# ----------------------------------------------------------------------------- checkpoints


def _through_a_checkpoint(state_dict):
    """Save and load, as a real checkpoint does. (Loading a live optimizer's state dict directly
    would make both optimizers share their moment tensors.)"""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _run(opt, params, steps, first_step=0):
    for step in range(first_step, first_step + steps):
        for p, g in zip(params, _grads(step)):
            p.grad = g.clone()
        opt.step()


@needs_gpu
def test_state_dict_has_torch_adam_layout_and_loads_into_torch_adamw():
    init = _initial_params()
    ours = [p.clone().requires_grad_() for p in init]
    opt = FusedAdam(ours, **HP)
    _run(opt, ours, 3)
    sd = opt.state_dict()
    first = sd["state"][0]
    assert set(first) == {"step", "exp_avg", "exp_avg_sq"}
    assert first["step"].dtype == torch.float32 and first["step"].dim() == 0 and first["step"].item() == 3

    theirs = [p.detach().clone().requires_grad_() for p in ours]
    ref_opt = torch.optim.AdamW(theirs, **HP)
    ref_opt.load_state_dict(_through_a_checkpoint(sd))
    _run(opt, ours, 5, first_step=3)
    _run(ref_opt, theirs, 5, first_step=3)
    _assert_params_close(ours, theirs)


@needs_gpu
def test_torch_adamw_state_dict_loads_into_fused_adam():
    init = _initial_params()
    theirs = [p.clone().requires_grad_() for p in init]
    ref_opt = torch.optim.AdamW(theirs, **HP)
    _run(ref_opt, theirs, 3)

    ours = [p.detach().clone().requires_grad_() for p in theirs]
    opt = FusedAdam(ours, **HP)
    opt.load_state_dict(_through_a_checkpoint(ref_opt.state_dict()))
    assert opt.param_groups[0]["adamw_mode"] is True
    assert opt.state[ours[0]]["exp_avg"].is_cuda
    _run(opt, ours, 5, first_step=3)
    _run(ref_opt, theirs, 5, first_step=3)
    _assert_params_close(ours, theirs)


# ----------------------------------------------------------------------------- bad input, no GPU needed


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if an op were loaded: every check must come before any launch."""

    def refuse(name="fused_adam"):
        raise AssertionError(f"the {name} op was loaded before the arguments were rejected")

    monkeypatch.setattr(fused_adam_module, "_op", refuse)
    monkeypatch.setattr(adam_module, "load", refuse)


def _cpu_lists(n=2, size=4):
    return ([torch.zeros(size) for _ in range(n)] for _ in range(4))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lr=-1.0), r"\blr\b"),
        (dict(betas=(1.0, 0.999)), r"betas\[0\]"),
        (dict(betas=(0.9, -0.1)), r"betas\[1\]"),
        (dict(eps=float("nan")), r"\beps\b"),
        (dict(weight_decay=-0.1), r"weight_decay"),
        (dict(amsgrad=True), r"amsgrad"),
    ],
)
def test_optimizer_rejects_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FusedAdam([torch.zeros(3, requires_grad=True)], **kwargs)


def test_optimizer_rejects_non_cuda_and_non_fp32_params():
    with pytest.raises(ValueError, match=r"params'\]\[0\] must be a CUDA tensor"):
        FusedAdam([torch.zeros(3, requires_grad=True)])
    with pytest.raises(ValueError, match=r"float32"):
        FusedAdam([torch.zeros(3, dtype=torch.float16, requires_grad=True)])
    with pytest.raises(ValueError, match=r"contiguous"):
        FusedAdam([torch.zeros(3, 4).t().requires_grad_()])


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(lr=-1.0), r"\blr\b"),
        (dict(betas=(0.9, 1.0)), r"betas\[1\]"),
        (dict(step=0), r"\bstep\b"),
        (dict(grad_scale=0.0), r"grad_scale"),
        (dict(grad_scale=float("inf")), r"grad_scale"),
    ],
)
def test_step_rejects_bad_scalars(no_launch, change, match):
    params, grads, exp_avgs, exp_avg_sqs = _cpu_lists()
    kwargs = dict(step=1, **HP)
    kwargs.update(change)
    with pytest.raises(ValueError, match=match):
        fused_adam_step(params, grads, exp_avgs, exp_avg_sqs, **kwargs)


def test_step_rejects_bad_tensors_before_looking_at_devices(no_launch):
    def call(**over):
        params, grads, exp_avgs, exp_avg_sqs = _cpu_lists()
        args = dict(params=params, grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs)
        args.update(over)
        fused_adam_step(args.pop("params"), args.pop("grads"), args.pop("exp_avgs"), args.pop("exp_avg_sqs"),
                        step=1, **HP, **args)  # fmt: skip

    with pytest.raises(ValueError, match=r"grads has 1 entries"):
        call(grads=[torch.zeros(4)])
    with pytest.raises(ValueError, match=r"params\[0\] must be float32, got torch.float64"):
        call(params=[torch.zeros(4, dtype=torch.float64), torch.zeros(4)])
    with pytest.raises(ValueError, match=r"grads\[1\] must be float32 or bfloat16 or float16"):
        call(grads=[torch.zeros(4), torch.zeros(4, dtype=torch.int32)])
    with pytest.raises(ValueError, match=r"exp_avgs\[0\] has 5 elements but param has 4"):
        call(exp_avgs=[torch.zeros(5), torch.zeros(4)])
    with pytest.raises(ValueError, match=r"exp_avg_sqs\[1\] must be float32"):
        call(exp_avg_sqs=[torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match=r"out16\[0\] must be bfloat16 or float16"):
        call(out16=[torch.zeros(4), None])
    with pytest.raises(ValueError, match=r"out16 has 1 entries"):
        call(out16=[None])
    with pytest.raises(ValueError, match=r"params\[1\] must be contiguous"):
        call(params=[torch.zeros(4), torch.zeros(8)[::2]])
    with pytest.raises(ValueError, match=r"params must be a list"):
        call(params=torch.zeros(4))
    # Every dtype and size is right: what is left is the devices (each tensor on its param's).
    with pytest.raises(ValueError, match=r"exp_avgs\[1\] is on meta but its param is on cpu"):
        call(exp_avgs=[torch.zeros(4), torch.zeros(4, device="meta")])


@needs_gpu
def test_step_rejects_mixed_devices_and_writes_nothing():
    params = [torch.ones(4, device="cuda") for _ in range(2)]
    grads = [torch.ones(4, device="cuda"), torch.ones(4)]
    exp_avgs = [torch.zeros(4, device="cuda") for _ in range(2)]
    exp_avg_sqs = [torch.zeros(4, device="cuda") for _ in range(2)]
    with pytest.raises(ValueError, match=r"grads\[1\] must be a CUDA tensor"):
        fused_adam_step(params, grads, exp_avgs, exp_avg_sqs, step=1, **HP)
    assert all(torch.equal(p, torch.ones(4, device="cuda")) for p in params)
    assert all(torch.equal(m, torch.zeros(4, device="cuda")) for m in exp_avgs)


@needs_gpu
def test_optimizer_step_rejects_a_wrong_out16_before_updating_anything():
    params = [p.requires_grad_() for p in _initial_params(shapes=[(8,), (8,)])]
    before = [p.detach().clone() for p in params]
    opt = FusedAdam(params, **HP)
    for p in params:
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match=r"out16\[1\]"):
        opt.step(out16=[None, torch.zeros(8, device="cuda")])  # float32 is not a 16-bit dtype
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    assert len(opt.state) == 0
