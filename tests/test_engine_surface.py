"""DeepSpeedEngine's acting methods (zero/deepspeed/engine_methods.py, on the facade
zero.deepspeed.initialize returns) and zero's Engine's own, the engine without an optimizer, and
zero.Init's DeepSpeed bookkeeping: an evaluation engine at every stage and HF generation under
stage 3 on 2 ranks against the plain model (also with TRL's hook removal), offload_states/
reload_states bit for bit against training without the round trip, batch-size changes against an
engine built with the new size, the module's state dict, rank queries."""
import pytest
import torch
import torch.nn as nn

import zero

ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def batch(i: int, rank: int = 0) -> torch.Tensor:
    return torch.randn(2, 8, generator=torch.Generator().manual_seed(10 * i + rank))


def test_engine_without_optimizer_evaluates_at_every_stage_and_refuses_to_train():
    for stage in range(4):
        model = mlp()
        want = [p.detach().clone() for p in model.parameters()]
        x = batch(0)
        with torch.no_grad():
            expected = model(x)
        engine, optimizer, _, scheduler = zero.initialize(
            model=model, config={"train_batch_size": 2, "zero_optimization": {
                "stage": stage, "stage3_param_persistence_threshold": 0}})
        assert scheduler is None and not engine.trains
        with torch.no_grad():
            assert torch.equal(engine(x), expected), stage
        with zero.GatheredParameters(list(model.parameters())):
            assert all(torch.equal(p.detach(), w) for p, w in zip(model.parameters(), want)), stage
        report = engine.memory_report()  # nothing of training is kept
        assert report["grads"] == report["fp32_master"] == report["optimizer_states"] == 0, (stage, report)
        assert report["params"] > 0 or stage < 3, report
        with pytest.raises(RuntimeError, match="without an optimizer"):
            engine.step()
        with pytest.raises(RuntimeError, match="without an optimizer"):
            engine.backward(engine(x).sum())
    with pytest.warns(UserWarning, match="'scheduler' section is ignored: this engine has no optimizer"):
        _, _, _, scheduler = zero.initialize(model=mlp(), config={"train_batch_size": 2,
                                                                  "scheduler": {"type": "WarmupLR"}})
    assert scheduler is None


def _generate(stage: int) -> dict:
    """Greedy generation of a tiny GPT-2: the plain model, the stage-`stage` engine without an
    optimizer (its forward hooks gathering each block), and TRL's pattern (every parameter
    gathered, the hooks removed for the loop and put back)."""
    import torch.distributed as dist
    import transformers

    from zero.deepspeed.runtime.zero import GatheredParameters

    def tiny():
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=64, n_positions=24, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=1))

    rank = dist.get_rank()
    prompt = torch.randint(2, 64, (2, 5), generator=torch.Generator().manual_seed(rank))  # each rank its own
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=1, eos_token_id=None)
    plain = tiny().eval()
    with torch.no_grad():
        want = plain.generate(prompt, **kw).tolist()
    engine, *_ = zero.initialize(model=tiny(), config={
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage,
                                                                  "stage3_param_persistence_threshold": 0}})
    engine.eval()
    with torch.no_grad():
        got = engine.generate(prompt, **kw).tolist()  # the module's method, through the engine
    out = {"hooked": got == want, "sharded": all(p.numel() == 0 for p in engine.module.parameters())}
    if stage == 3:
        offload = engine.optimizer.parameter_offload
        with GatheredParameters(list(engine.module.parameters())), torch.no_grad():
            for handle in offload.forward_hooks + offload.backward_hooks:
                handle.remove()
            offload.forward_hooks, offload.backward_hooks = [], []
            out["trl"] = engine.module.generate(prompt, **kw).tolist() == want
            offload._register_hooks_recursively(offload.module)
        with torch.no_grad():  # the hooks are back: a sharded forward works again
            out["after"] = torch.equal(engine(prompt).logits, plain(prompt).logits)
        out["summary"] = engine.module.lm_head.weight.ds_summary()["ds_shape"] == (64, 32)
        from zero.deepspeed.runtime.zero import unwrap_model_for_generation

        with unwrap_model_for_generation(engine) as unwrapped, torch.no_grad():  # DeepSpeed's: no hooks inside
            out["unwrap"] = not offload.forward_hooks and unwrapped.generate(prompt, **kw).tolist() == want
        out["unwrap"] = out["unwrap"] and len(offload.forward_hooks) > 0
    return out


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_generate_without_optimizer_matches_the_plain_model_on_two_ranks(dist_run, stage):
    pytest.importorskip("transformers", reason="needs transformers (pip install 'zero[hf]')")
    for r in dist_run(2, _generate, stage):
        assert r["hooked"], r
        if stage == 3:
            assert r["sharded"] and r["trl"] and r["after"] and r["summary"] and r["unwrap"], r


def _train(stage: int, roundtrip: bool, config: dict | None = None, steps: int = 4) -> dict:
    """Steps on a bf16 MLP; with `roundtrip`, the states go to host memory and back after step 2
    (all of them, and whoever runs the model meanwhile is refused), and in two parts after step 3
    (the optimizer's states first: the model still evaluates; then the rest)."""
    import torch.distributed as dist

    from zero.deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as States

    model = mlp()
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": ADAMW, "bf16": {"enabled": True},
           "gradient_clipping": 1.0, "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
           **(config or {})}
    engine, *_ = zero.initialize(model=model, config=cfg)
    rank = dist.get_rank() if dist.is_initialized() else 0
    out = {"refused": []}

    def refused(fn) -> None:
        try:
            fn()
            out["refused"].append(False)
        except RuntimeError as e:
            out["refused"].append("reload_states" in str(e) or "after engine.step()" in str(e))

    x0 = batch(0).bfloat16()
    for i in range(steps):
        loss = engine(batch(i, rank).bfloat16()).float().pow(2).mean()
        engine.backward(loss)
        if roundtrip and i == 0:
            refused(engine.offload_states)  # between a backward and its step
        engine.step()
        if roundtrip and i == 1:
            before = engine.memory_report()
            engine.offload_states()
            after = engine.memory_report()
            out["device_before"], out["device_after"], out["offloaded"] = (
                before["device_bytes"], after["device_bytes"], after["offloaded_bytes"])
            refused(lambda: engine(x0))
            refused(lambda: model(x0))  # the module itself, not through the engine
            refused(lambda: engine.step())
            engine.reload_states()
        if roundtrip and i == 2:  # DeepSpeed's OffloadStateTypeEnum values, in two calls
            engine.offload_states([States.optim_states, "hp_params"])
            with torch.no_grad():
                out["evaluates"] = engine(x0).shape == (2, 4)
            engine.offload_states(["lp_grads"])
            refused(lambda: engine(x0))  # with autograd on: a backward would need the gradient buffers
            refused(lambda: engine.step())  # a step needs every state
            engine.offload_states()  # the rest
            out["all_away"] = engine.memory_report()["device_bytes"] == 0
            engine.reload_states()
    with zero.GatheredParameters(list(model.parameters())):
        out["params"] = [p.detach().float().clone() for p in model.parameters()]
    return out


def test_offload_states_round_trip_frees_the_device_and_trains_bit_for_bit(dist_run):
    sgd = {"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}}
    for stage, extra in [(3, None), (2, None), (1, sgd), (0, {"optimizer": {"type": "ZeroOneAdam"}}),
                         (3, {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}})]:
        plain = dist_run(2, _train, stage, False, extra)
        tripped = dist_run(2, _train, stage, True, extra)
        for a, b in zip(plain, tripped):
            assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"])), stage
            assert b["device_before"] > 0 and b["device_after"] == 0 and b["offloaded"] > 0, (stage, b)
            assert b["refused"] == [True] * 6 and b["evaluates"] and b["all_away"], (stage, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_offload_states_frees_gpu_memory():
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)])
    engine, *_ = zero.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": ADAMW, "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    x = torch.randn(2, 512, device="cuda", dtype=torch.bfloat16)
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    states = engine.memory_report()["device_bytes"]
    engine.offload_states()
    freed = held - torch.cuda.memory_allocated()
    assert freed >= states > 8 * 512 * 512 * 14, (freed, states)  # 2 bf16 + 4 master + 8 moments per element
    engine.reload_states()
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()


def test_engine_methods_with_deepspeeds_meaning(tmp_path):
    class WithHelper(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()
            self.label = "mine"

        def forward(self, x):
            return self.net(x)

        def twice(self, x):
            return 2 * self.net(x)

    import zero.deepspeed as deepspeed  # DeepSpeed's methods: the facade's engine (zero/deepspeed/engine.py)

    model = WithHelper()
    engine, *_ = deepspeed.initialize(model=model, config={"train_micro_batch_size_per_gpu": 2, "optimizer": ADAMW,
                                                           "gradient_accumulation_steps": 2})
    x = batch(0)
    assert engine.label == "mine" and torch.equal(engine.twice(x), 2 * engine(x))  # the module's, through the engine
    with pytest.raises(AttributeError, match="neither the engine nor its module"):
        getattr(engine, "no_such_thing")  # noqa: B009
    assert engine.get_batch_info() == (4, 2, 2)
    assert (engine.get_data_parallel_rank(), engine.get_model_parallel_rank(), engine.get_tensor_parallel_rank(),
            engine.get_sequence_parallel_group(), engine.dp_world_size, engine.mp_world_size) == (0, 0, 0, None, 1, 1)
    assert engine.is_map_style_dataset([1, 2]) and not engine.is_iterable_style_dataset([1, 2])
    loader = engine.deepspeed_io(torch.utils.data.TensorDataset(torch.arange(10.0)))
    assert next(iter(loader))[0].shape == (2,)
    # the module's state dict, saved and loaded
    state = {k: v.clone() for k, v in engine.module_state_dict().items()}
    assert set(state) == set(model.state_dict())
    with torch.no_grad():
        model.net[0].weight.add_(1.0)
    engine.load_module_state_dict({"module": state})
    assert torch.equal(model.net[0].weight, state["net.0.weight"])
    with pytest.raises(ValueError, match="'module'"):
        engine.load_module_state_dict(state)
    assert engine.save_fp16_model(tmp_path) and (tmp_path / "model.safetensors").exists()
    # the batch size, changed at a boundary, trains as an engine built with it
    with pytest.raises(ValueError, match="multiple of"):
        engine.set_train_batch_size(3)
    engine.set_train_batch_size(6)
    assert engine.get_batch_info() == (6, 2, 3) and engine.gradient_accumulation_steps() == 3
    steps = []
    for i in range(6):
        engine.backward(engine(batch(i)).pow(2).mean())
        engine.step()
        steps.append(engine.was_step_applied())
    assert steps == [False, False, True] * 2
    fresh_model = WithHelper()
    fresh, *_ = deepspeed.initialize(model=fresh_model, config={"train_micro_batch_size_per_gpu": 2,
                                                                "optimizer": ADAMW, "gradient_accumulation_steps": 3})
    fresh.load_module_state_dict({"module": state})
    for i in range(6):
        fresh.backward(fresh(batch(i)).pow(2).mean())
        fresh.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh_model.parameters()))
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    with pytest.raises(RuntimeError, match="inside an accumulation window"):
        engine.set_train_batch_size(4)
    engine.set_train_micro_batch_size(4)
    assert engine.get_batch_info() == (12, 4, 3)
    engine.empty_partition_cache()
    engine.destroy()


def _init_bookkeeping() -> dict:
    import torch.distributed as dist

    from zero.deepspeed.runtime.zero import Init, register_external_parameter, unregister_external_parameter

    class Tied(nn.Module):
        def __init__(self, own_init: bool = True):
            super().__init__()
            with Init(enabled=own_init):  # a model's own Init inside the caller's: the outer one shards
                self.embed = nn.Embedding(16, 8)
            self.head = nn.Linear(8, 8)
            register_external_parameter(self.head, self.embed.weight)

        def forward(self, x):
            return self.head(self.embed(x)) @ self.embed.weight.t()

    @Init()  # as a decorator
    def build():
        return Tied()

    torch.manual_seed(0)
    model = build()
    out = {"sharded": all(p.numel() == 0 for p in model.parameters()),
           "external": list(model.head._external_params.values()) == [model.embed.weight]
           and [p for _, p in model.head.ds_external_parameters()] == [model.embed.weight]
           and model.embed.weight.is_external_param and not model.head.weight.is_external_param,
           "summary": model.head.weight.ds_summary()["status"] == "NOT_AVAILABLE"
           and model.head.weight.ds_summary()["ds_shape"] == (8, 8)
           and model.head.weight.partition_numel() * dist.get_world_size() == model.head.weight.aligned_size()}
    # Init(module=...) shards an existing model; initialize called inside an Init context
    torch.manual_seed(0)
    plain = Tied(own_init=False)
    with torch.no_grad():
        want = plain(torch.arange(4).view(1, 4))
    other = Tied.__new__(Tied)
    nn.Module.__init__(other)
    torch.manual_seed(0)
    other.embed, other.head = nn.Embedding(16, 8), nn.Linear(8, 8)
    register_external_parameter(other.head, other.embed.weight)
    Init(module=other)
    out["module_arg"] = all(p.numel() == 0 for p in other.parameters())
    with Init():
        engine, *_ = zero.initialize(model=other, config={"train_micro_batch_size_per_gpu": 1, "optimizer": ADAMW,
                                                          "zero_optimization": {"stage": 3}})
    with torch.no_grad():
        out["forward"] = torch.allclose(engine(torch.arange(4).view(1, 4)), want)
    try:
        unregister_external_parameter(model.head, model.head.weight)
    except RuntimeError as e:
        out["unregister"] = "not a registered external parameter" in str(e)
    try:
        Init(mpu=object())
    except ValueError as e:
        out["mpu"] = "mpu" in str(e)
    return out


def test_zero_init_bookkeeping_nesting_decorator_and_initialize_inside(dist_run):
    for r in dist_run(2, _init_bookkeeping):
        assert all(r.values()) and len(r) == 7, r


def _tags(root: str) -> dict:
    import warnings

    import torch.distributed as dist

    from zero.checkpoint.training import CheckpointError
    from zero.deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    rank = dist.get_rank()
    out = {}
    for validation in ("Warn", "Fail"):
        engine, *_ = zero.initialize(model=mlp(), config={"train_micro_batch_size_per_gpu": 2, "optimizer": ADAMW,
                                                          "checkpoint": {"tag_validation": validation.lower()}})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                path = engine.save_checkpoint(f"{root}/{validation}", tag=f"t{rank}")
                out[validation] = path.endswith("t0") and (rank > 0 or any("rank 1: 't1'" in str(w.message)
                                                                            for w in caught))
            except CheckpointError as e:
                out[validation] = "rank 0: 't0', rank 1: 't1'" in str(e)
    try:
        engine.save_checkpoint(None)
    except ValueError as e:
        out["none"] = "save_dir=None" in str(e)
    dist.barrier()
    if rank == 0:
        files = convert_zero_checkpoint_to_fp32_state_dict(f"{root}/Warn", f"{root}/fp32", tag="t0")
        state = torch.load(f"{root}/fp32/pytorch_model.bin", weights_only=True)
        out["bin"] = files[-1].endswith("pytorch_model.bin") and set(state) == set(mlp().state_dict())
    return out


def test_checkpoint_tag_validation_and_deepspeeds_fp32_output(dist_run, tmp_path):
    results = dist_run(2, _tags, str(tmp_path))
    assert all(r["Warn"] and r["Fail"] and r["none"] for r in results) and results[0]["bin"], results
    from zero.config import load_config

    pipe = load_config({"train_batch_size": 1, "pipeline": {"activation_checkpoint_interval": 2,
                                                            "use_reentrant": True}}).pipeline
    assert (pipe.activation_checkpoint_interval, pipe.use_reentrant) == (2, True)


def test_deepspeed_engine_members_exist_with_their_meaning_or_explain_themselves():
    """Every public member of DeepSpeed 0.19.8's DeepSpeedEngine beyond nn.Module (the generated
    list in zero/deepspeed/engine_members.txt) exists on the DeepSpeedEngine facade over zero's Engine:
    at least 90% with DeepSpeed's meaning (the accessors, checked in tests/test_engine_accessors.py,
    and the methods, checked above), the rest raising NotAvailableError that says why; zero's own
    Engine has none of DeepSpeed's accessors."""
    import zero.deepspeed as deepspeed
    from zero.deepspeed._missing import NotAvailableError, engine_members
    from zero.deepspeed.engine import DeepSpeedEngine as Engine
    from zero.deepspeed.engine_methods import NOT_AVAILABLE

    members = engine_members()
    assert len(members) == 175, len(members)
    absent = [n for n in members if not hasattr(Engine, n)]
    assert not absent, absent
    real = [n for n in members if n not in NOT_AVAILABLE]
    assert len(real) / len(members) >= 0.9, (len(real), len(members))
    assert not hasattr(zero.Engine, "fp16_enabled") and not hasattr(zero.Engine, "get_batch_info")
    engine, *_ = deepspeed.initialize(model=mlp(), config={"train_micro_batch_size_per_gpu": 2, "optimizer": ADAMW})
    for name in NOT_AVAILABLE:
        with pytest.raises(NotAvailableError, match=f"engine.{name} is not available in zero: .+"):
            getattr(engine, name)()
    # the collectives DeepSpeed's non-ZeRO path offers, on tensors of one's own (a world of one here)
    grads = [torch.ones(3), torch.full((2, 2), 2.0)]
    engine.allreduce_no_retain(grads, None, numel_per_bucket=2)
    assert torch.equal(grads[1], torch.full((2, 2), 2.0)) and engine.all_gather_scalar(torch.tensor(5.0), None) == [5.0]
    assert engine.get_type() == ["AdamW"] and engine.is_compiled is False and engine.collect_python_gc() >= 0


def _set_fragments(stage: int) -> dict:
    """safe_set_full_grad: the step applies the gradient set (SGD with lr 1: w - g);
    safe_set_local_fp32_param / safe_set_local_optimizer_state: this rank's part, read back."""
    import torch.distributed as dist

    from zero.deepspeed.utils import (
        safe_get_full_fp32_param,
        safe_get_full_grad,
        safe_get_local_fp32_param,
        safe_get_local_optimizer_state,
        safe_set_full_grad,
        safe_set_local_fp32_param,
        safe_set_local_optimizer_state,
        safe_update_full_grad_vectorized,
    )

    rank = dist.get_rank()
    zc = {"stage": stage, "stage3_param_persistence_threshold": 0}
    model = mlp()
    engine, *_ = zero.initialize(model=model, config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": zc,
                                                      "optimizer": {"type": "SGD", "params": {"lr": 1.0}}})
    weight = model[2].weight
    engine.backward(engine(batch(0, rank)).pow(2).mean())
    g = torch.arange(16 * 16, dtype=torch.float32).view(16, 16) / 100
    before = safe_get_full_fp32_param(weight)
    safe_set_full_grad(weight, g / 2)
    safe_update_full_grad_vectorized([weight, model[0].weight], lambda grad, p: grad * 2 if p is weight else grad)
    out = {"grad": torch.allclose(safe_get_full_grad(weight), g, atol=1e-6)}
    engine.step()
    out["applied"] = torch.allclose(safe_get_full_fp32_param(weight), before - g, atol=1e-6)
    adam = mlp()
    engine, *_ = zero.initialize(model=adam, config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": zc,
                                                     "optimizer": ADAMW})
    engine.backward(engine(batch(0, rank)).pow(2).mean())
    engine.step()
    w = adam[2].weight
    mine = safe_get_local_optimizer_state(w, "exp_avg")
    safe_set_local_optimizer_state(w, torch.full_like(mine, 0.5 + rank), "exp_avg")
    out["state"] = torch.equal(safe_get_local_optimizer_state(w, "exp_avg"), torch.full_like(mine, 0.5 + rank))
    if stage == 3:
        local = safe_get_local_fp32_param(w)
        safe_set_local_fp32_param(w, local + 1)
        with zero.GatheredParameters([w]):
            out["local"] = torch.equal(safe_get_local_fp32_param(w), local + 1) and torch.allclose(
                w.detach().reshape(-1)[rank * local.numel():][: local.numel()], local + 1)
    else:
        try:
            safe_set_local_fp32_param(w, torch.zeros(1))
        except ValueError as e:
            out["local"] = "stage 3 only" in str(e)
    return out


def test_deepspeed_tensor_fragment_setters(dist_run):
    for stage in (1, 2, 3):
        for r in dist_run(2, _set_fragments, stage):
            assert all(r.values()) and len(r) == 4, (stage, r)


def _join(rank: int, path: str, out) -> None:
    import os

    import torch.distributed as dist

    import zero.deepspeed as deepspeed

    for key in ("WORLD_SIZE", "MASTER_ADDR", "RANK", "LOCAL_RANK"):
        os.environ.pop(key, None)
    deepspeed.init_distributed(dist_backend="gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    t = torch.tensor([rank + 1.0])
    deepspeed.comm.all_reduce(t)
    out.put((rank, dist.get_world_size(), t.item()))
    dist.destroy_process_group()


def test_init_distributed_with_init_method_rank_and_world_size(tmp_path):
    """DeepSpeed's init_distributed(init_method=..., rank=..., world_size=...), as DeepSpeed's own test
    harness starts its ranks, without a launcher's environment."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_join, args=(r, str(tmp_path / "rendezvous"), out)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    assert got == [(0, 2, 3.0), (1, 2, 3.0)], got
