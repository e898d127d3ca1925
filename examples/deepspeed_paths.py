"""A DeepSpeed script that reaches into DeepSpeed's deeper module paths, as transformers, PEFT, TRL
and accelerate do, written from DeepSpeed's documentation with one change: `import deepspeed`
became `import zero.deepspeed as deepspeed` (and `from deepspeed.` became `from zero.deepspeed.`).

Every name below is used once. The model is also trained by plain torch beside the engine, with the
same edits, and the script reports how far the two are apart.

    torchrun --nproc_per_node 2 examples/deepspeed_paths.py --stage 3

tests/test_deepspeed_paths.py runs `main` on 2 gloo ranks at stages 1, 2 and 3.
"""
from __future__ import annotations

import argparse
import shutil
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F

import zero.deepspeed as deepspeed
from zero.deepspeed.accelerator import get_accelerator
from zero.deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder
from zero.deepspeed.pipe import PipelineModule  # noqa: F401 - imported and never used: must not break the script
from zero.deepspeed.runtime.engine import DeepSpeedEngine
from zero.deepspeed.runtime.zero import ZeroParamStatus as Status
from zero.deepspeed.runtime.zero import unwrap_model_for_generation
from zero.deepspeed.runtime.zero.config import (
    DeepSpeedZeroConfig,
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedZeroOffloadParamConfig,
)
from zero.deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
from zero.deepspeed.runtime.zero.partition_parameters import GatheredParameters, Init, ZeroParamStatus
from zero.deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from zero.deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from zero.deepspeed.runtime.zero.utils import ZeRORuntimeException
from zero.deepspeed.utils import (
    get_z3_leaf_modules,
    safe_get_local_grad,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
    safe_set_local_grad,
    set_z3_leaf_modules,
    unset_z3_leaf_modules,
    z3_leaf_module,
)
from zero.deepspeed.utils.zero_to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)

CLAMP = 0.05  # this script's own gradient edit: clamp each gradient element


class Experts(nn.Module):
    """Top-1 routing between two experts: which expert runs depends on the data (a z3 leaf)."""

    def __init__(self, width: int):
        super().__init__()
        self.gate = nn.Linear(width, 2)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(2))

    def forward(self, x):
        choice = self.gate(x).argmax(dim=-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            if (choice == i).any():
                out[choice == i] = expert(x[choice == i])
        return out + self.gate(x).sum(-1, keepdim=True) * 0.01


class Net(nn.Module):
    def __init__(self, width: int = 12):
        super().__init__()
        self.inp = nn.Linear(6, width)
        self.moe = Experts(width)
        self.out = nn.Linear(width, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.moe(torch.tanh(self.inp(x)))))


def main(stage: int, steps: int = 3) -> dict:
    accelerator = get_accelerator()
    assert accelerator.is_available()
    device = accelerator.current_device_name()
    report = {"device": accelerator.device_name(), "backend": accelerator.communication_backend_name(),
              "cpu_adam": CPUAdamBuilder().is_compatible(), "fused_adam": FusedAdamBuilder().is_compatible()}
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()

    ds_config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                              "offload_optimizer": {"device": "none"}},
    }
    zero_config = DeepSpeedZeroConfig(**ds_config["zero_optimization"])  # read as DeepSpeed's model
    assert zero_config.stage == stage and zero_config.param_persistence_threshold == 0
    assert zero_config.offload_optimizer.device == OffloadDeviceEnum.none
    assert DeepSpeedZeroOffloadOptimizerConfig(device="cpu").device == OffloadDeviceEnum.cpu
    assert DeepSpeedZeroOffloadParamConfig(device="cpu", pin_memory=True).pin_memory

    accelerator.manual_seed(0)
    with Init(config_dict_or_path=ds_config, enabled=stage == 3):
        model = Net()
    accelerator.manual_seed(0)
    reference = Net()  # plain torch, same initial values
    set_z3_leaf_modules(model, [Experts, nn.Linear])
    unset_z3_leaf_modules(model, [nn.Linear])
    assert z3_leaf_module(model.moe) and get_z3_leaf_modules(model) == [model.moe]

    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=ds_config)
    assert isinstance(engine, DeepSpeedEngine)
    assert isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3 if stage == 3 else DeepSpeedZeroOptimizer)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    box = [tempfile.mkdtemp() if rank == 0 else None]
    deepspeed.comm.broadcast_object_list(box, src=0)  # one checkpoint directory for all ranks
    path = box[0]
    engine.save_checkpoint(path, tag="init")  # saved at world 2: the single-process model's state, bitwise
    initial = get_fp32_state_dict_from_zero_checkpoint(path, tag="init")
    report["init_bitwise"] = all(torch.equal(initial[n], p) for n, p in reference.state_dict().items())

    if stage == 3:  # the attributes transformers, PEFT and TRL read
        params = list(model.parameters())
        report["ds_numel_total"] = sum(p.ds_numel for p in params)  # PEFT's print_trainable_parameters
        weight = model.inp.weight
        report["released"] = weight.ds_status == ZeroParamStatus.NOT_AVAILABLE and weight.numel() == 0
        report["status_paths"] = Status is ZeroParamStatus  # runtime.zero's and partition_parameters' are one
        report["ds_tensor"] = weight.ds_tensor.numel() == -(-weight.ds_numel // world)
        report["ds_ids"] = len({p.ds_id for p in params}) == len(params)
        report["ds_persist"] = not any(p.ds_persist for p in params)
        weight.all_gather()
        report["all_gather"] = tuple(weight.shape) == tuple(weight.ds_shape) == (12, 6)
        weight.partition()
        report["partition"] = weight.numel() == 0
    report["full_count"] = sum(p.numel() for p in reference.parameters())

    new_bias = torch.linspace(-1, 1, 3)  # the same on every rank, as DeepSpeed requires
    safe_set_full_fp32_param(model.out.bias, new_bias)
    safe_set_full_optimizer_state(model.out.bias, torch.zeros(3), "exp_avg")
    with torch.no_grad():
        reference.out.bias.copy_(new_bias)

    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4 * world, 6, generator=g), torch.randn(4 * world, 3, generator=g)
        mine = slice(4 * rank, 4 * rank + 4)
        engine.backward(F.mse_loss(engine(x[mine].to(device)), y[mine].to(device)))
        if stage >= 2:  # DeepSpeed defines the local gradient for partitioned gradients only
            for p in model.parameters():
                safe_set_local_grad(p, safe_get_local_grad(p).clamp(-CLAMP, CLAMP))
        engine.step()

        ref_opt.zero_grad()
        F.mse_loss(reference(x), y).backward()
        if stage >= 2:
            for p in reference.parameters():
                p.grad.clamp_(-CLAMP, CLAMP)
        ref_opt.step()

    with unwrap_model_for_generation(engine) as unwrapped:  # every parameter gathered for generation
        probe = torch.randn(2, 6, generator=torch.Generator().manual_seed(9))
        report["generate_error"] = (unwrapped(probe) - reference(probe)).abs().max().item()
    with GatheredParameters(list(model.parameters())):
        trained = {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}
    report["param_error"] = max((trained[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters())

    engine.save_checkpoint(path, tag="final")
    try:
        engine.load_checkpoint(path, tag="no_such_tag")
        report["runtime_exception"] = False
    except ZeRORuntimeException as e:  # zero's runtime errors are DeepSpeed's ZeRO exception
        report["runtime_exception"] = "no_such_tag" in str(e)
    state = get_fp32_state_dict_from_zero_checkpoint(path, tag="final")
    report["fp32_bitwise"] = state.keys() == trained.keys() and all(torch.equal(state[n], trained[n]) for n in state)
    plain = load_state_dict_from_zero_checkpoint(Net(), path, tag="final")
    report["loaded_bitwise"] = all(torch.equal(p, trained[n]) for n, p in plain.named_parameters())
    if rank == 0:
        convert_zero_checkpoint_to_fp32_state_dict(path, f"{path}/hf", tag="final", safe_serialization=True)
        from safetensors.torch import load_file

        report["converted_bitwise"] = torch.equal(load_file(f"{path}/hf/model.safetensors")["out.bias"],
                                                  trained["out.bias"])
    deepspeed.comm.barrier()  # rank 0 removes the directory only after every rank read it
    if rank == 0:
        shutil.rmtree(path)
    accelerator.synchronize()
    report["memory_allocated"] = accelerator.memory_allocated()
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, default=3, choices=(1, 2, 3))
    deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    deepspeed.init_distributed()
    result = main(args.stage)
    if deepspeed.comm.get_rank() == 0:
        for key, value in result.items():
            print(f"{key}: {value}")
