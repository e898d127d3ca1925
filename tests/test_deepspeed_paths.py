"""DeepSpeed's deeper module paths and stage-3 parameter attributes (part of issue 20)."""
import torch
import torch.nn as nn

import zero
import zero.deepspeed as deepspeed
from zero.deepspeed.runtime.engine import DeepSpeedEngine
from zero.deepspeed.runtime.zero import unwrap_model_for_generation
from zero.deepspeed.runtime.zero.config import DeepSpeedZeroConfig
from zero.deepspeed.runtime.zero.partition_parameters import GatheredParameters, ZeroParamStatus
from zero.deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from zero.deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 33), nn.Tanh(), nn.Linear(33, 5))


def stage3_attributes(path: str):
    model = _net()
    full_count = sum(p.numel() for p in model.parameters())
    engine, optimizer, *_ = zero.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    engine.backward(engine(torch.randn(2, 8)).square().mean())
    engine.step()
    weight = model[0].weight
    released = weight.ds_status is ZeroParamStatus.NOT_AVAILABLE and weight.numel() == 0
    counted = sum(p.ds_numel for p in model.parameters())  # how PEFT and transformers count under ZeRO-3
    shard = weight.ds_tensor.numel() == -(-weight.ds_numel // 2) and tuple(weight.ds_shape) == (33, 8)
    weight.all_gather()
    gathered = weight.shape == (33, 8) and weight.ds_status is ZeroParamStatus.AVAILABLE
    weight.partition()
    with GatheredParameters(list(model.parameters())):
        masters = {n: p.detach().clone() for n, p in model.named_parameters()}
    with unwrap_model_for_generation(engine) as unwrapped:
        whole = unwrapped[0].weight.shape == (33, 8)
    engine.save_checkpoint(path)
    return dict(released=released, counted=counted == full_count, shard=shard, gathered=gathered,
                back=weight.numel() == 0, whole=whole, masters=masters,
                types=isinstance(engine, DeepSpeedEngine) and isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3))


def test_stage3_parameter_attributes_and_module_paths(dist_run, tmp_path):
    results = dist_run(2, stage3_attributes, str(tmp_path))
    for r in results:
        assert r["released"] and r["counted"] and r["shard"] and r["gathered"] and r["back"] and r["whole"]
        assert r["types"]
    state = get_fp32_state_dict_from_zero_checkpoint(tmp_path)  # saved at world 2, read in one process
    assert state.keys() == results[0]["masters"].keys()
    assert all(torch.equal(state[n], results[0]["masters"][n]) for n in state)  # bitwise (fp32)
    assert DeepSpeedZeroConfig(stage=3, stage3_param_persistence_threshold=0).stage == 3
    accelerator = deepspeed.accelerator.get_accelerator()
    assert accelerator.device_name() == "cpu" and accelerator.communication_backend_name() == "gloo"


def set_and_get(stage: int):
    model = _net()
    engine, *_ = zero.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}})
    weight = model[2].weight
    value = torch.arange(weight.ds_numel if stage == 3 else weight.numel(), dtype=torch.float32).view(5, 33)
    deepspeed.utils.safe_set_full_fp32_param(weight, value)
    deepspeed.utils.safe_set_full_optimizer_state(weight, value * 2, "exp_avg")
    got = deepspeed.utils.safe_get_full_fp32_param(weight)
    state = deepspeed.utils.safe_get_full_optimizer_state(weight, "exp_avg")
    with GatheredParameters([weight]):
        seen = weight.detach().clone()
    return torch.equal(got, value) and torch.equal(state, value * 2) and torch.equal(seen, value)


def test_safe_set_full_fp32_param_and_optimizer_state(dist_run):
    for stage in (1, 2, 3):
        assert dist_run(2, set_and_get, stage) == [True, True], stage
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))
    zero.set_z3_leaf_modules(model, [nn.Sequential])
    assert deepspeed.utils.z3_leaf_module(model[1]) and len(deepspeed.utils.get_z3_leaf_modules(model)) == 2
    deepspeed.utils.unset_z3_leaf_modules(model, [nn.Sequential])
    assert deepspeed.utils.get_z3_leaf_modules(model) == []


def test_op_builders_answer_for_zeros_ops():
    from zero.deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder
    from zero.ops import builder

    assert CPUAdamBuilder().is_compatible() == (builder.missing("cpu_adam") is None)
    assert FusedAdamBuilder().is_compatible() == (builder.missing("fused_adam") is None)
    if CPUAdamBuilder().is_compatible():
        assert CPUAdamBuilder().load() is builder.load("cpu_adam")


def edit_gradients(stage: int, offload: bool):
    """safe_get_full_grad / safe_get_local_grad against the reference gradient, then
    safe_set_local_grad changes what the step applies (Adam is sign-sensitive)."""
    import copy

    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _net()
    reference = copy.deepcopy(model)
    zero_cfg = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if offload:
        zero_cfg["offload_optimizer"] = {"device": "cpu"}
    engine, optimizer, *_ = zero.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 3, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "fp16": {"enabled": False}, "zero_optimization": zero_cfg})
    x = torch.randn(3 * world, 8, generator=torch.Generator().manual_seed(1))
    engine.backward(engine(x[3 * rank : 3 * rank + 3]).square().mean())
    reference(x).square().mean().backward()
    names = dict(model.named_parameters())
    full = {n: deepspeed.utils.safe_get_full_grad(p) for n, p in names.items()}
    errors = {n: (full[n] - q.grad).abs().max().item() for n, q in reference.named_parameters()}
    if stage < 2:
        try:
            deepspeed.utils.safe_get_local_grad(names["0.weight"])
            local_refused = False
        except ValueError as e:
            local_refused = "reduced inside step()" in str(e)
        engine.step()
        return dict(errors=errors, local_refused=local_refused)
    local_ok = True
    for n, p in names.items():
        offset, _, _ = optimizer.grad_piece(p)
        local = deepspeed.utils.safe_get_local_grad(p)
        local_ok &= torch.allclose(local, full[n].reshape(-1)[offset : offset + local.numel()], rtol=0, atol=1e-7)
        edited = -local if n == "0.weight" else (torch.zeros_like(local) if n == "2.bias" else local)
        deepspeed.utils.safe_set_local_grad(p, edited)
    try:
        deepspeed.utils.safe_set_local_grad(names["0.bias"], torch.zeros(1000))
        size_refused = False
    except ValueError as e:
        size_refused = "got (1000,)" in str(e)
    engine.step()
    reference[0].weight.grad.neg_()
    reference[2].bias.grad.zero_()
    torch.optim.Adam(reference.parameters(), lr=1e-2).step()
    with GatheredParameters(list(model.parameters())):
        after = {n: (p.detach() - dict(reference.named_parameters())[n].detach()).abs().max().item()
                 for n, p in names.items()}
    return dict(errors=errors, local_ok=local_ok, size_refused=size_refused, after=after)


def test_safe_get_and_set_gradients_against_the_reference(dist_run):
    for stage, offload in ((1, False), (2, False), (3, False), (2, True), (3, True)):
        for r in dist_run(2, edit_gradients, stage, offload):
            assert max(r["errors"].values()) < 1e-6, (stage, offload, r["errors"])
            if stage < 2:
                assert r["local_refused"]
                continue
            assert r["local_ok"] and r["size_refused"], (stage, offload)
            assert max(r["after"].values()) < 1e-6, (stage, offload, r["after"])  # the edited gradients were applied


def run_script(stage: int) -> dict:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "examples" / "deepspeed_paths.py"
    spec = importlib.util.spec_from_file_location("deepspeed_paths", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script.main(stage)


def test_a_deepspeed_script_using_every_deeper_path_matches_torch(dist_run):
    """examples/deepspeed_paths.py: every path of issue 20 imported from zero.deepspeed and used
    once, at stages 1-3 on 2 ranks, against plain torch on the whole batch."""
    for stage in (1, 2, 3):
        reports = dist_run(2, run_script, stage, timeout=120)
        for r in reports:
            assert r["device"] == "cpu" and r["backend"] == "gloo" and not r["fused_adam"], r
            assert r["param_error"] < 1e-6 and r["generate_error"] < 1e-5, (stage, r)
            assert r["runtime_exception"] and r["fp32_bitwise"] and r["loaded_bitwise"], (stage, r)
            if stage == 3:
                assert r["ds_numel_total"] == r["full_count"], r
                assert all(r[k] for k in ("released", "ds_tensor", "ds_ids", "ds_persist", "all_gather", "partition"))
        assert reports[0]["converted_bitwise"]
