"""Low-precision Adam state: bf16 master weights (stochastic rounding), bf16 and 8-bit moments.

The kernel formats against their scalar reference and torch's, the rounding's statistics, the
8-bit codes, and the engine at every stage with and without offload on 2 ranks: ranks agree,
training tracks fp32 states, checkpoints resume bit for bit and convert between formats, the
memory report counts the formats as stored, bad configs name their key.
"""
from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zero
from zero.config import load_config
from zero.config.errors import ConfigError
from zero.ops.adam_formats import (
    Q8_BLOCK,
    AdamFormat,
    decode_moment,
    encode_moment,
    sr_key,
    sr_words,
    to_bf16_stochastic,
)
from zero.ops.cpu_adam import simd_levels
from zero.testing.adam import keyword_step

cpu_adam_step_fmt = keyword_step(checked=True)
torch_adam_step_fmt = keyword_step(checked=None)


FORMATS = [AdamFormat(m, s, sr) for m in ("fp32", "bf16") for s in ("fp32", "bf16", "int8") for sr in (False, True)
           if (m, s) != ("fp32", "fp32")]
HYPER = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, grad_scale=2.0)


def _state(fmt: AdamFormat, n: int, seed: int = 0, tiny: bool = True):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=g).to(fmt.master_dtype)
    m, v = torch.randn(n, generator=g) * 0.1, torch.rand(n, generator=g) * 0.01
    if tiny:  # tiny second moments: the codes must keep them (and Adam's step there is ill-conditioned)
        v[: n // 7] *= 1e-9
    if fmt.quantized:
        (m, ms), (v, vs) = encode_moment(m, "exp_avg"), encode_moment(v, "exp_avg_sq")
    else:
        m, v, ms, vs = m.to(fmt.state_dtype), v.to(fmt.state_dtype), None, None
    return [p, m, v, ms, vs]


def _bits(ts):
    return [t.view(torch.uint8) if t.dtype != torch.uint8 else t for t in ts if t is not None]


def _step(fmt, state, grad, out16, *, index, step=3, split=None, **kw):
    p, m, v, ms, vs = state
    if split is None:
        cpu_adam_step_fmt(p, grad, m, v, fmt=fmt, m_scale=ms, v_scale=vs, out16=out16, index=index, step=step,
                          **HYPER, **kw)
        return
    q = lambda t, a, b: None if t is None else t[a // Q8_BLOCK : -(-b // Q8_BLOCK)]  # noqa: E731
    for a, b in ((0, split), (split, p.numel())):
        cpu_adam_step_fmt(p[a:b], grad[a:b], m[a:b], v[a:b], fmt=fmt, m_scale=q(ms, a, b), v_scale=q(vs, a, b),
                          out16=out16[a:b], index=index + a, step=step, **HYPER, **kw)


def test_every_format_gives_the_same_bits_at_every_simd_level_thread_count_and_split():
    n = 3 * 16384 + 1000  # several tiles, a partial block and a partial vector
    grad = torch.randn(n, generator=torch.Generator().manual_seed(1)).bfloat16()
    for fmt in FORMATS:
        ref = _state(fmt, n)
        out_ref = torch.empty(n, dtype=torch.bfloat16)
        _step(fmt, ref, grad, out_ref, index=2**32 - 5000, simd="scalar", num_threads=1)  # the counter's high word moves
        for simd in simd_levels():
            for threads, split in ((1, None), (2, None), (2, 16384 + 512)):
                got, out = _state(fmt, n), torch.empty(n, dtype=torch.bfloat16)
                _step(fmt, got, grad, out, index=2**32 - 5000, simd=simd, num_threads=threads, split=split)
                for a, b in zip(_bits(got + [out]), _bits(ref + [out_ref])):
                    assert torch.equal(a, b), (fmt, simd, threads, split)
        # other gradient and copy-out dtypes (fp32 gradients, no copy, an fp16 copy), best level only
        for gd, od in ((torch.float32, None), (torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16)):
            g2 = grad.to(gd)
            runs = []
            for simd in ("scalar", simd_levels()[0]):
                st, o = _state(fmt, n), None if od is None else torch.empty(n, dtype=od)
                p, m, v, ms, vs = st
                cpu_adam_step_fmt(p, g2, m, v, fmt=fmt, m_scale=ms, v_scale=vs, out16=o, index=7, step=2,
                                  simd=simd, num_threads=2, **HYPER)
                runs.append(_bits(st + [o]))
            assert all(torch.equal(a, b) for a, b in zip(*runs)), (fmt, gd, od)
        # torch's reference: the same roundings and codes; only an fp32 master may differ by round-off.
        # Well-conditioned moments here: with v near 0, m / sqrt(v) turns torch's and the kernel's
        # last-bit differences (fma or not, by ATen's vector/scalar split) into large ones
        ref, out_ref = _state(fmt, n, tiny=False), torch.empty(n, dtype=torch.bfloat16)
        _step(fmt, ref, grad, out_ref, index=2**32 - 5000, simd="scalar", num_threads=1)
        tor, out_t = _state(fmt, n, tiny=False), torch.empty(n, dtype=torch.bfloat16)
        torch_adam_step_fmt(tor[0], grad, tor[1], tor[2], m_scale=tor[3], v_scale=tor[4], out16=out_t, fmt=fmt, index=2**32 - 5000,
                            step=3, **HYPER)
        if fmt.master == "bf16":
            assert torch.equal(tor[0].view(torch.int16), ref[0].view(torch.int16)), fmt
        else:
            # the update, not the weight, is what round-off is relative to. ATen and the kernel differ
            # in fmas and in where ATen splits vector from scalar code (which moves with its thread
            # count), so a few elements may differ more; a wrong formula moves all of them
            update = (ref[0] - _state(fmt, n, tiny=False)[0]).abs()
            off = (tor[0] - ref[0]).abs() / (update + 1e-7)
            assert (off <= 1e-2).float().mean() > 0.99 and off.max() < 0.5, (fmt, off.max().item())
        same = [(a == b).float().mean().item() for a, b in zip(_bits(tor[1:]), _bits(ref[1:]))]
        assert min(same) > 0.999, (fmt, same)  # a code or rounding may flip where fp32 round-off differs


def test_the_output_copy_of_a_bf16_master_is_the_master_and_the_fp32_path_is_unchanged():
    n = 5000
    fmt = AdamFormat("bf16", "bf16", True)
    state, grad, out = _state(fmt, n), torch.randn(n).bfloat16(), torch.empty(n, dtype=torch.bfloat16)
    _step(fmt, state, grad, out, index=0)
    assert torch.equal(out.view(torch.int16), state[0].view(torch.int16))
    with pytest.raises(ValueError, match="m_scale is required"):
        q8 = AdamFormat("fp32", "int8")
        s = _state(q8, n)
        cpu_adam_step_fmt(s[0], grad, s[1], s[2], fmt=q8, step=1, **HYPER)
    with pytest.raises(ValueError, match="exp_avg"):
        s = _state(fmt, n)
        cpu_adam_step_fmt(s[0], grad, s[1].float(), s[2], fmt=fmt, step=1, **HYPER)


def test_stochastic_rounding_is_unbiased_and_leaves_bf16_values_alone():
    n = 1 << 20
    # an update far below half an ulp: at step 1 Adam moves every weight by lr (m / sqrt(v) = sign(g))
    for stochastic in (False, True):
        fmt = AdamFormat("bf16", "fp32", stochastic)
        p = torch.ones(n, dtype=torch.bfloat16)
        m, v = torch.zeros(n), torch.zeros(n)
        cpu_adam_step_fmt(p, torch.ones(n), m, v, fmt=fmt, step=1, lr=1e-3, betas=(0.9, 0.999), eps=0.0,
                          weight_decay=0.0)
        moved = 1.0 - p.double().mean().item()
        if stochastic:
            assert abs(moved - 1e-3) < 0.05 * 1e-3, moved  # the fp32 amount, within 5%
            assert set(p.float().unique().tolist()) == {1.0, 1.0 - 2**-8}
        else:
            assert moved == 0.0  # round to nearest: every update lost
    # a value bf16 holds exactly is its own rounding, whatever the random bits
    x = torch.randn(n).bfloat16()
    words = sr_words(sr_key(7, 3), 0, n)
    assert torch.equal(to_bf16_stochastic(x.float(), words).view(torch.int16), x.view(torch.int16))
    # many roundings of one value average to it
    y = torch.full((n,), 1.0 + 2**-10)
    rounded = to_bf16_stochastic(y, sr_words(sr_key(1, 1), 0, n)).double()
    assert abs(rounded.mean().item() - (1.0 + 2**-10)) < 2e-6
    # the same (seed, step, index) gives the same words; another step, others
    assert torch.equal(sr_words(sr_key(1, 2), 10, 100), sr_words(sr_key(1, 2), 0, 110)[10:])
    assert not torch.equal(sr_words(sr_key(1, 2), 0, 100), sr_words(sr_key(1, 3), 0, 100))


def test_8bit_codes_keep_small_values_and_round_trip_exactly():
    g = torch.Generator().manual_seed(0)
    m = torch.randn(4096, generator=g) * torch.logspace(-6, 0, 4096)  # magnitudes over six decades in each block
    v = m.square() + 1e-20
    for x, which in ((m, "exp_avg"), (v, "exp_avg_sq")):
        codes, scales = encode_moment(x, which)
        assert codes.dtype == torch.uint8 and scales.numel() == 4096 // Q8_BLOCK
        back = decode_moment(codes, scales, which)
        big = x.abs() > x.abs().view(-1, Q8_BLOCK).amax(1).repeat_interleave(Q8_BLOCK) * 2.0**-14
        assert ((back - x).abs()[big] <= x.abs()[big] / 16).all()  # 3 mantissa bits, rounded to nearest
        assert torch.equal(encode_moment(back, which)[0], codes)  # a decoded value is its own code
        assert torch.equal(back.bfloat16().float(), back)  # every code is a bf16 number (checkpoints)
    v_back = decode_moment(*encode_moment(v, "exp_avg_sq"), "exp_avg_sq")
    blockmax = v.view(-1, Q8_BLOCK).amax(1).repeat_interleave(Q8_BLOCK)
    assert (v_back[v > blockmax * 2.0**-30] > 0).all()  # v's range is m's squared: small v is not flushed


# ------------------------------------------------------------------------------------ the engine

class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(32, 256), nn.Linear(256, 256), nn.Linear(256, 8)

    def forward(self, x):
        return self.c(F.gelu(self.b(F.gelu(self.a(x)))))


def _config(stage, master="fp32", state="fp32", offload=False, **extra):
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
           "bf16": {"enabled": True, "bf16_master_weights_and_grads": master == "bf16"},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}, **extra}
    if state != "fp32":
        cfg["optimizer"]["params"]["state_dtype"] = state
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    return cfg


def _batches(rank, steps, seed=0):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return [(torch.randn(4, 32, generator=g), torch.randn(4, 8, generator=g)) for _ in range(steps)]


def _train(engine, batches):
    loss = None
    for x, y in batches:
        loss = F.mse_loss(engine(x.bfloat16()).float(), y)
        engine.backward(loss)
        engine.step()
    return loss.item()


def _full_params(engine, stage):
    ctx = zero.GatheredParameters(list(engine.module.parameters())) if stage == 3 else torch.no_grad()
    with ctx:
        return torch.cat([p.detach().float().reshape(-1).clone() for p in engine.module.parameters()])


def _formats_track_fp32_states():
    import torch.distributed as dist

    rank, out = dist.get_rank(), {}
    for stage in (0, 1, 2, 3):
        for offload in (False, True):
            runs = {}
            for master, state in (("fp32", "fp32"), ("bf16", "bf16"), ("fp32", "int8"), ("bf16", "int8")):
                engine, *_ = zero.initialize(model=_Net(), config=_config(stage, master, state, offload))
                losses = [_train(engine, _batches(rank, 1, s)) for s in range(30)]
                w = _full_params(engine, stage)
                everyone = [torch.empty_like(w) for _ in range(dist.get_world_size())]
                dist.all_gather(everyone, w)
                runs[(master, state)] = (sum(losses[-10:]) / 10, w, all(torch.equal(everyone[0], o) for o in everyone))
                engine.destroy()
            out[(stage, offload)] = runs
    return out


def test_every_stage_and_offload_trains_in_each_format_like_fp32_states(dist_run):
    results = dist_run(2, _formats_track_fp32_states)
    for (stage, offload), runs in results[0].items():
        base_loss, base_w, _ = runs[("fp32", "fp32")]
        for (master, state), (loss, w, agree) in runs.items():
            what = (stage, offload, master, state)
            assert agree, f"ranks disagree on the parameters: {what}"
            bound = 0.01 if state != "int8" else 0.02
            assert abs(loss - base_loss) <= bound * base_loss, (what, loss, base_loss)
            assert ((w - base_w).norm() / base_w.norm()).item() < 0.02, what
    assert torch.equal(results[0][(2, False)][("bf16", "int8")][1], results[1][(2, False)][("bf16", "int8")][1])


def _resume_and_convert(tmp):
    import torch.distributed as dist

    from zero.accessors import safe_get_full_optimizer_state

    rank, out = dist.get_rank(), {}
    for stage in (2, 3):
        for master, state in (("fp32", "bf16"), ("bf16", "bf16"), ("fp32", "int8"), ("bf16", "int8")):
            cfg = _config(stage, master, state, offload=stage == 3)
            a, *_ = zero.initialize(model=_Net(), config=cfg)
            _train(a, _batches(rank, 3))
            a.save_checkpoint(f"{tmp}/{stage}{master}{state}", tag="t")
            if rank == 0:  # to-fp32 consolidation still gives fp32 weights (a bf16 master's values, widened)
                from zero.checkpoint.consolidate import get_fp32_state_dict

                sd = get_fp32_state_dict(f"{tmp}/{stage}{master}{state}", tag="t")
                same = stage == 3 or master != "bf16" or all(
                    torch.equal(sd[n], p.detach().float()) for n, p in a.module.named_parameters())
                out[("fp32", stage, master, state)] = all(t.dtype == torch.float32 for t in sd.values()) and same
            _train(a, _batches(rank, 3, seed=1))
            b, *_ = zero.initialize(model=_Net(), config=cfg)
            b.load_checkpoint(f"{tmp}/{stage}{master}{state}", tag="t")
            _train(b, _batches(rank, 3, seed=1))
            states = lambda e: [t for s in e.optimizer.slots() for t in (s.master, *s.state.values())]  # noqa: E731
            out[("resume", stage, master, state)] = all(
                torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(states(a), states(b)))
            # the same checkpoint into fp32 states and back, and fp32 states into this format
            c, *_ = zero.initialize(model=_Net(), config=_config(stage))
            seen: list[str] = []
            handler = logging.Handler()
            handler.emit = lambda record, seen=seen: seen.append(record.getMessage())
            logging.getLogger("zero").addHandler(handler)
            logging.getLogger("zero").setLevel(logging.INFO)
            c.load_checkpoint(f"{tmp}/{stage}{master}{state}", tag="t")
            logging.getLogger("zero").removeHandler(handler)
            out[("logged", stage, master, state)] = any("converted once" in m and f"moments {state}" in m for m in seen)
            out[("into fp32", stage, master, state)] = [
                (f"{kind}", float(safe_get_full_optimizer_state(p, kind).float().norm()))
                for p in list(c.module.parameters())[:1] for kind in ("exp_avg", "exp_avg_sq")]
            d, *_ = zero.initialize(model=_Net(), config=_config(stage, master, state))
            d.load_checkpoint(f"{tmp}/{stage}{master}{state}", tag="t")
            out[("direct", stage, master, state)] = [
                (f"{kind}", float(safe_get_full_optimizer_state(p, kind).float().norm()))
                for p in list(d.module.parameters())[:1] for kind in ("exp_avg", "exp_avg_sq")]
            c.save_checkpoint(f"{tmp}/fp32-{stage}{master}{state}", tag="t")
            e, *_ = zero.initialize(model=_Net(), config=cfg)
            e.load_checkpoint(f"{tmp}/fp32-{stage}{master}{state}", tag="t")
            out[("from fp32", stage, master, state)] = [
                (f"{kind}", float(safe_get_full_optimizer_state(p, kind).float().norm()))
                for p in list(e.module.parameters())[:1] for kind in ("exp_avg", "exp_avg_sq")]
            for x in (a, b, c, d, e):
                x.destroy()
    return out


def test_checkpoints_resume_each_format_bit_for_bit_and_convert_between_formats(dist_run, tmp_path):
    out = dist_run(2, _resume_and_convert, str(tmp_path))[0]
    for key, value in out.items():
        if key[0] in ("resume", "logged", "fp32"):
            assert value, key
    for key in [k for k in out if k[0] == "direct"]:
        direct = dict(out[key])
        for other in ("into fp32", "from fp32"):
            got = dict(out[(other, *key[1:])])
            for kind, norm in direct.items():
                assert abs(got[kind] - norm) <= 1e-3 * norm, (other, key, kind, got[kind], norm)


def test_the_memory_report_counts_the_formats_as_stored():
    psi = sum(p.numel() for p in _Net().parameters())
    per_param = {}
    for master, state in (("fp32", "fp32"), ("bf16", "bf16"), ("fp32", "int8"), ("bf16", "int8")):
        engine, *_ = zero.initialize(model=_Net(), config=_config(3, master, state))
        report = engine.memory_report()
        per_param[(master, state)] = report["model_states_total"] / psi
        if master == "bf16":
            assert report["fp32_master"] == 0  # the bf16 parameters are their own master
        engine.destroy()
    assert per_param[("fp32", "fp32")] == pytest.approx(16, rel=0.01)
    assert per_param[("bf16", "bf16")] <= 8.05
    assert per_param[("fp32", "int8")] <= 10.1
    assert per_param[("bf16", "int8")] <= 6.1


def test_bad_format_settings_name_their_key():
    base = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    cases = [
        ({"optimizer": {"type": "AdamW", "params": {"state_dtype": "int4"}}}, "optimizer.params.state_dtype"),
        ({"fp16": {"enabled": True}, "bf16": {"bf16_master_weights_and_grads": True}},
         "bf16.bf16_master_weights_and_grads"),
        ({"fp16": {"enabled": True}, "bf16": {"bf16_optimizer_states": True}}, "bf16.bf16_optimizer_states"),
        ({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "state_dtype": "int8"}}}, "state_dtype"),
        ({"optimizer": {"type": "OneBitAdam", "params": {"state_dtype": "int8"}}}, "optimizer.params.state_dtype"),
        ({"bf16": {"enabled": True, "bf16_optimizer_states": True},
          "optimizer": {"type": "AdamW", "params": {"state_dtype": "int8"}}}, "optimizer.params.state_dtype"),
        ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True},
          "optimizer": {"type": "Lion", "params": {"lr": 1e-4}}}, "bf16.bf16_master_weights_and_grads"),
        ({"bf16": {"enabled": True, "stochastic_rounding": True}}, "bf16.stochastic_rounding"),
        ({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "state_dtype": "int8"}}}, "optimizer.params.state_dtype"),
    ]
    for extra, key in cases:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config({**copy.deepcopy(base), **extra})
    cfg = load_config({**base, "bf16": {"enabled": True, "bf16_master_weights_and_grads": True,
                                        "bf16_optimizer_states": True, "stochastic_rounding": False}})
    from zero.stages.policies import Precision

    p = Precision.from_config(cfg)
    assert (p.adam.master, p.adam.state, p.adam.stochastic, p.grad) == ("bf16", "bf16", False, torch.bfloat16)


def test_deepspeed_cpu_adam_without_fp32_states_keeps_moments_in_the_training_dtype():
    from zero.deepspeed.ops.adam import DeepSpeedCPUAdam

    model = _Net()
    opt = DeepSpeedCPUAdam(model.parameters(), lr=1e-3, fp32_optimizer_states=False)
    engine, *_ = zero.initialize(model=model, optimizer=opt, config={
        "train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True}})
    assert {s.state["exp_avg"].dtype for s in engine.optimizer.slots()} == {torch.bfloat16}
    _train(engine, _batches(0, 2))
    engine.destroy()
    with pytest.raises(ValueError, match=r"fp32_optimizer_states=False\) under fp16"):
        model = _Net()
        zero.initialize(model=model, optimizer=DeepSpeedCPUAdam(model.parameters(), fp32_optimizer_states=False),
                        config={"train_micro_batch_size_per_gpu": 4, "fp16": {"enabled": True}})


def test_pipeline_ties_across_stages_refuse_stochastic_rounding():
    from zero.ops.adam_formats import AdamFormat
    from zero.pipe.schedule import refuse_diverging_ties

    class Tied:
        tied_modules = {"embed": None}

        @staticmethod
        def tied_stages(key):
            return [0, 1]

    with pytest.raises(ConfigError, match="bf16.stochastic_rounding"):
        refuse_diverging_ties(Tied(), AdamFormat("bf16", "bf16", True))
    refuse_diverging_ties(Tied(), AdamFormat("bf16", "bf16", False))  # rounded to nearest: the copies stay equal
    refuse_diverging_ties(Tied(), AdamFormat("fp32", "int8", True))  # 8-bit codes round to nearest


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_engine_steps_each_format_on_the_gpu_like_on_the_cpu():
    """The engine's CUDA path (fused Adam in the formats) against its CPU path, stage 2 and 3."""
    for stage in (2, 3):
        for master, state in (("bf16", "bf16"), ("fp32", "int8"), ("bf16", "int8")):
            results = {}
            for device in ("cpu", "cuda"):
                torch.set_default_device(device)
                try:
                    engine, *_ = zero.initialize(model=_Net().to(device), config=_config(stage, master, state))
                    for x, y in _batches(0, 3):
                        loss = F.mse_loss(engine(x.to(device).bfloat16()).float(), y.to(device))
                        engine.backward(loss)
                        engine.step()
                    results[device] = _full_params(engine, stage).cpu()
                    engine.destroy()
                finally:
                    torch.set_default_device("cpu")
            assert ((results["cpu"] - results["cuda"]).norm() / results["cpu"].norm()).item() < 1e-2, (stage, master, state)


def test_the_end_tables_format_rows_take_a_config_that_sets_the_rounding():
    """The end table estimates every format from the run's config: a row that stores nothing in
    bf16 drops `bf16.stochastic_rounding` instead of failing the config's check."""
    from zero.estimate import estimate_memory

    for rounding in (True, False):
        cfg = _config(2, "bf16", "bf16")
        cfg["bf16"]["stochastic_rounding"] = rounding
        table = estimate_memory(_Net(), 2, config=cfg, state_formats=True)
        assert "fp32 master + fp32 moments" in str(table) and "bf16 master + 8-bit moments" in str(table)
