"""DeepSpeed programs as its documentation and tutorials write them, with one change: the import.

Each part follows one page of DeepSpeed's docs (written here in our own words and code):
  getting_started  initialize(args=..., model_parameters=...) with the config from
                   --deepspeed_config, a client lr scheduler, save/load_checkpoint with client_state
  zero_init        the ZeRO-3 tutorial: zero.Init(config_dict_or_path=...), GatheredParameters
                   with modifier_rank, register_external_parameter, ds_* attributes
  config_objects   the engine's config accessors and DeepSpeed's config objects
  inference        initialize without an optimizer under ZeRO-3: an evaluation engine
  rlhf             offload_states / reload_states around generation, as RLHF libraries do
  schedules        the schedule names and helpers of deepspeed.runtime.lr_schedules

    torchrun --nproc_per_node 2 examples/deepspeed_tutorials.py --part all
    ZERO_EXAMPLE_REAL_DEEPSPEED=1 DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 examples/deepspeed_tutorials.py

The second line runs the same program on DeepSpeed itself (where it is installed), which is how
this file was checked to be a DeepSpeed program. tests/test_deepspeed_programs.py runs every part on
2 gloo ranks under zero and checks its numbers against the ones DeepSpeed printed.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F

if os.environ.get("ZERO_EXAMPLE_REAL_DEEPSPEED"):
    import deepspeed  # the program as DeepSpeed runs it
else:
    import zero.deepspeed as deepspeed  # the one changed line


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.body = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.head = nn.Linear(16, 32, bias=False)

    def forward(self, tokens):
        return self.head(self.body(self.embed(tokens)))


def batches(rank: int, n: int, rows: int = 4):
    g = torch.Generator().manual_seed(1000 + rank)
    for _ in range(n):
        x = torch.randint(0, 32, (rows, 6), generator=g)
        yield x, torch.roll(x, 1, dims=1)


def rank_and_world() -> tuple[int, int]:
    return deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()


def getting_started(stage: int, workdir: str) -> dict:
    """Getting Started: a config file given on the command line, a client scheduler, checkpoints
    with client_state, and a resumed run that continues exactly."""
    parser = argparse.ArgumentParser()
    parser = deepspeed.add_config_arguments(parser)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
              "gradient_clipping": 1.0, "zero_optimization": {"stage": stage}}
    path = os.path.join(workdir, f"ds_config_{stage}_rank{deepspeed.comm.get_rank()}.json")
    with open(path, "w") as fh:
        json.dump(config, fh)
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", path])
    torch.manual_seed(0)
    net = Net()
    engine, optimizer, _, scheduler = deepspeed.initialize(
        args=args, model=net, model_parameters=net.parameters(),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step)))
    rank, _ = rank_and_world()
    losses = []
    for step, (x, y) in enumerate(batches(rank, 8)):
        loss = F.cross_entropy(engine(x).flatten(0, 1), y.flatten())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if step == 3:
            engine.save_checkpoint(os.path.join(workdir, f"ckpt{stage}"), tag="mid", client_state={"step": step})
    final = {n: p.detach().clone() for n, p in engine.module.named_parameters()} if stage < 3 else None
    # resume from the middle in a fresh engine: the second half again, the same result
    torch.manual_seed(1)
    net2 = Net()
    engine2, *_ = deepspeed.initialize(
        args=args, model=net2, model_parameters=net2.parameters(),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step)))
    _, client_state = engine2.load_checkpoint(os.path.join(workdir, f"ckpt{stage}"), tag="mid")
    resumed = []
    for step, (x, y) in enumerate(batches(rank, 8)):
        if step <= client_state["step"]:
            continue
        loss = F.cross_entropy(engine2(x).flatten(0, 1), y.flatten())
        engine2.backward(loss)
        engine2.step()
        resumed.append(loss.item())
    same = final is None or all(torch.equal(final[n], p) for n, p in engine2.module.named_parameters())
    return {"losses": losses, "resumed_same": same and resumed == losses[4:], "steps": engine.global_steps,
            "lr": engine.get_lr()[0], "scheduler": scheduler is engine.lr_scheduler}


def zero_init(workdir: str) -> dict:
    """The ZeRO-3 tutorial: a model built already partitioned, changed inside GatheredParameters,
    a module using another's weight, trained a few steps."""
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}

    class Tied(Net):
        def __init__(self):
            super().__init__()
            deepspeed.zero.register_external_parameter(self, self.embed.weight)

        def forward(self, tokens):
            return self.body(self.embed(tokens)) @ self.embed.weight.t()

    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = Tied()
    partitioned = all(p.ds_status == deepspeed.runtime.zero.ZeroParamStatus.NOT_AVAILABLE for p in model.parameters())
    numel = sum(p.ds_numel for p in model.parameters())
    with deepspeed.zero.GatheredParameters(model.head.weight, modifier_rank=0):
        if deepspeed.comm.get_rank() == 0:
            nn.init.zeros_(model.head.weight)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    rank, _ = rank_and_world()
    for x, y in batches(rank, 3):
        loss = F.cross_entropy(engine(x).flatten(0, 1), y.flatten())
        engine.backward(loss)
        engine.step()
    with deepspeed.zero.GatheredParameters(list(model.head.parameters())):
        head_zero = bool((model.head.weight == 0).all())  # unused in forward: Adam leaves it as set
    summary = model.body[0].weight.ds_summary()
    return {"partitioned": partitioned, "numel": numel == sum(p.numel() for p in Net().parameters()),
            "head_zero": head_zero, "summary": summary["ds_shape"] == (32, 16), "loss": loss.item()}


def config_objects() -> dict:
    """The engine's accessors and DeepSpeed's config objects, read as DeepSpeed code reads them."""
    zero_config = importlib.import_module(f"{deepspeed.__name__}.runtime.zero.config")
    config = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
              "gradient_clipping": 0.5,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=Net(), config=config)
    zc = engine._config.zero_config  # DeepSpeed's parsed config: engine.zero_optimization() is a bool
    return {"bf16": engine.bfloat16_enabled(), "fp16": engine.fp16_enabled(), "clip": engine.gradient_clipping(),
            "stage": engine.zero_optimization_stage(), "offload": engine.zero_offload_optimizer().device,
            "pipeline": zc.offload_optimizer.pipeline, "read": engine.zero_offload_optimizer().pipeline_read,
            "weights": engine.zero_optimization_partition_weights(), "zero": engine.zero_optimization(),
            "name": engine.optimizer_name(), "batch": list(map(_value, engine.get_batch_info())),
            "built": zero_config.DeepSpeedZeroConfig(stage=3).stage == 3}


def _value(x):
    return x() if callable(x) else x  # DeepSpeed 0.19's get_batch_info() returns its accessor methods


def inference() -> dict:
    """Evaluation under ZeRO-3 without an optimizer: the parameters partitioned, each module's
    gathered around its forward; the outputs are the plain model's."""
    torch.manual_seed(0)
    plain = Net().eval()
    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=Net(), config={
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3,
                                                                  "stage3_param_persistence_threshold": 0}})
    engine.eval()
    rank, _ = rank_and_world()
    x, _ = next(batches(rank, 1))
    with torch.no_grad():
        same = torch.allclose(engine(x), plain(x), atol=1e-6)
    return {"same": same, "partitioned": all(p.numel() == 0 for p in engine.module.parameters())}


def rlhf() -> dict:
    """An RLHF step: the policy's states leave the device while another model generates."""
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}
    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=Net(), config=config)
    rank, _ = rank_and_world()
    losses = []
    for x, y in batches(rank, 3):
        engine.offload_states()  # generation with another model would run here
        engine.reload_states()
        loss = F.cross_entropy(engine(x).float().flatten(0, 1), y.flatten())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses}


def schedules() -> dict:
    s = importlib.import_module(f"{deepspeed.__name__}.runtime.lr_schedules")

    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    warm = s.WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=0.1, warmup_num_steps=4, warmup_type="linear")
    lrs = []
    for _ in range(6):
        opt.step()
        warm.step()
        lrs.append(round(warm.get_last_lr()[0], 6))
    return {"names": [s.WARMUP_LR, s.WARMUP_DECAY_LR, s.ONE_CYCLE, s.LR_RANGE_TEST], "lrs": lrs,
            "valid": s.WARMUP_COSINE_LR in s.VALID_LR_SCHEDULES}


def main(part: str = "all", stage: int = 2, workdir: str | None = None) -> dict:
    deepspeed.init_distributed()
    if workdir is None:  # one directory for all ranks (checkpoints are shared)
        workdir = os.path.join(tempfile.gettempdir(), f"ds_tutorials_{os.environ.get('MASTER_PORT', 'local')}")
    os.makedirs(workdir, exist_ok=True)
    parts = {"getting_started": lambda: getting_started(stage, workdir), "zero_init": lambda: zero_init(workdir),
             "config_objects": config_objects, "inference": inference, "rlhf": rlhf, "schedules": schedules}
    return {name: fn() for name, fn in parts.items() if part in ("all", name)}


if __name__ == "__main__":
    cli = argparse.ArgumentParser()
    cli.add_argument("--part", default="all")
    cli.add_argument("--stage", type=int, default=2)
    cli.add_argument("--local_rank", type=int, default=0)
    a = cli.parse_args()
    out = main(a.part, a.stage)
    if deepspeed.comm.get_rank() == 0:
        print(json.dumps(out, indent=1, default=str))
