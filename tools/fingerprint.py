"""Freeze behaviour across a restructuring: train a matrix of small runs and record their exact bits.

    python tools/fingerprint.py save before.json      # before the change
    python tools/fingerprint.py compare before.json   # after it: every number must be the same

Each case trains a tiny model under zero for a few steps on gloo ranks (zero/testing/dist.py) and
records, bit for bit, what a user could observe: the parameters (gathered), the fp32 master and
optimizer states (through DeepSpeed's accessors, where the optimizer has them), the losses, the
gradient norm, the logical bytes of every collective, the measured memory report, and the
parameters after a checkpoint is saved, loaded into a fresh engine and trained one more step.
Hashes are sha256 of the raw bytes, so equal means equal to the last bit. Besides those cases it
records the numbers the equivalence tests' own helpers return (their errors against torch are
floats computed from the parameters, so they move with any bit).

A number that differs is printed with its case; the exit status is 1 if any differs. Run it on
the same machine and torch before and after (SIMD paths and torch versions change bits).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        if t is None:
            h.update(b"none")
            continue
        t = t.detach().cpu().contiguous()
        h.update(str(t.dtype).encode())
        h.update(t.view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def _optimizer(kind: str, params):
    import torch

    from zero.optim.lion import Lion

    return {"client-rmsprop": lambda: torch.optim.RMSprop(params, lr=0.01, momentum=0.5),
            "client-sgd": lambda: torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
            "client-lion": lambda: Lion(params, lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1),
            "client-adagrad": lambda: torch.optim.Adagrad(params, lr=0.05, lr_decay=0.1,
                                                          initial_accumulator_value=0.1),
            "client-adamw": lambda: torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)}[kind]()


def _config(case: dict) -> dict:
    zc = {"stage": case["stage"], **({"reduce_bucket_size": 500} if case["stage"] < 3 else
                                     {"stage3_param_persistence_threshold": 20,
                                      "stage3_module_granularity_threshold": 300}), **case.get("zc", {})}
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": case.get("accumulation", 1),
           "gradient_clipping": case.get("clip", 0.0), "zero_optimization": zc, "steps_per_print": 10**9}
    if "optimizer" in case:
        cfg["optimizer"] = case["optimizer"]
    if case.get("precision", "fp32") != "fp32":
        cfg[case["precision"]] = {"enabled": True, **case.get("precision_extra", {})}
    return {**cfg, **case.get("extra", {})}


def _build(case: dict):
    import torch

    import zero
    from zero.testing.training import build_model

    torch.manual_seed(0)
    model = build_model(case.get("model", "mlp"))
    client = case.get("client")
    engine, *_ = zero.initialize(model=model, config=_config(case),
                                 optimizer=_optimizer(client, model.parameters()) if client else None)
    return engine, model


def _train(engine, case: dict, steps: range) -> list[str]:
    import torch
    import torch.distributed as dist

    from zero.testing.training import make_batch

    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in steps:
        g = torch.Generator().manual_seed(1000 + step)
        for _ in range(case.get("accumulation", 1)):
            x, y = make_batch(case.get("model", "mlp"), 4 * world, g)
            x, y = x[4 * rank : 4 * rank + 4], y[4 * rank : 4 * rank + 4]
            if x.is_floating_point():
                x, y = x.to(engine.config.dtype), y.to(engine.config.dtype)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.float().item()).hex())
    return losses


def _observe(engine, model) -> dict:
    import zero
    from zero.deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    params = list(model.parameters())
    with zero.GatheredParameters(params):
        out = {"params": _digest(params)}
    states = {}
    for key in ("fp32", "exp_avg", "exp_avg_sq", "momentum_buffer"):
        try:
            got = [safe_get_full_fp32_param(p) if key == "fp32" else safe_get_full_optimizer_state(p, key)
                   for p in params if p.requires_grad]
            states[key] = _digest(got)
        except Exception as exc:  # noqa: BLE001 - what refuses is part of the behaviour
            states[key] = f"raises {type(exc).__name__}"
    out["states"] = states
    norm = engine.get_global_grad_norm()
    out["grad_norm"] = None if norm is None else float(norm).hex()
    out["comm"] = engine.comm_report()
    memory = engine.memory_report()
    out["memory"] = {k: v for k, v in memory.items() if isinstance(v, int)}
    return out


def run_case(case: dict) -> dict:
    """One case on this rank: train, observe, save, resume in a fresh engine, train one more step."""
    import torch
    import torch.distributed as dist

    steps = case.get("steps", 4)
    engine, model = _build(case)
    result = {"losses": _train(engine, case, range(steps))}
    result.update(_observe(engine, model))
    directory = case["dir"]
    try:
        engine.save_checkpoint(directory, tag="fp")
        saved = True
    except Exception as exc:  # noqa: BLE001
        result["save"] = f"raises {type(exc).__name__}: {str(exc)[:80]}"
        saved = False
    if saved:
        again, model2 = _build(case)
        again.load_checkpoint(directory, tag="fp")
        result["resumed_losses"] = _train(again, case, range(steps, steps + 1))
        with __import__("zero").GatheredParameters(list(model2.parameters())):
            result["resumed_params"] = _digest(list(model2.parameters()))
    dist.barrier()
    del engine
    torch.manual_seed(0)
    return result


def _cases() -> list[tuple[str, int, dict]]:
    adamw = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}
    adam = {"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.1, "adam_w_mode": False}}
    muon = {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 3e-3, "weight_decay": 0.01}}
    off = {"offload_optimizer": {"device": "cpu"}}
    cases = []
    for stage in (0, 1, 2, 3):
        cases.append((f"adamw-s{stage}-w2", 2, {"stage": stage, "optimizer": adamw}))
    for stage in (1, 2, 3):
        cases.append((f"adamw-s{stage}-w3-clip-acc2", 3, {"stage": stage, "optimizer": adamw, "clip": 0.05,
                                                          "accumulation": 2}))
        cases.append((f"gpt-bf16-s{stage}-w3", 3, {"stage": stage, "optimizer": adamw, "model": "gpt",
                                                    "precision": "bf16", "clip": 1.0}))
        cases.append((f"offload-bf16-s{stage}-w2", 2, {"stage": stage, "optimizer": adamw, "precision": "bf16",
                                                       "zc": off}))
    cases.append(("adam-l2-fp16-s2-w2", 2, {"stage": 2, "optimizer": adam, "precision": "fp16",
                                            "precision_extra": {"initial_scale_power": 8}}))
    cases.append(("adam-l2-fp16-s3-w2", 2, {"stage": 3, "optimizer": adam, "precision": "fp16",
                                            "precision_extra": {"initial_scale_power": 8}}))
    cases.append(("offload-param-s3-w2", 2, {"stage": 3, "optimizer": adamw, "precision": "bf16",
                                             "zc": {**off, "offload_param": {"device": "cpu"}}}))
    cases.append(("adamw-s3-w1", 1, {"stage": 3, "optimizer": adamw}))
    cases.append(("adamw-s2-w1-offload", 1, {"stage": 2, "optimizer": adamw, "zc": off}))
    fmt = {"type": "AdamW", "params": {"lr": 1e-2, "state_dtype": "int8"}}
    cases.append(("int8-states-s3-w2", 2, {"stage": 3, "optimizer": fmt, "precision": "bf16"}))
    cases.append(("int8-states-s1-w2-offload", 2, {"stage": 1, "optimizer": fmt, "precision": "bf16", "zc": off}))
    cases.append(("bf16-master-s2-w2", 2, {"stage": 2, "optimizer": adamw, "precision": "bf16",
                                           "precision_extra": {"bf16_master_weights_and_grads": True,
                                                               "bf16_optimizer_states": True}}))
    cases.append(("rs-false-s2-w2", 2, {"stage": 2, "optimizer": adamw, "zc": {"reduce_scatter": False}}))
    cases.append(("overlap-s2-w3", 3, {"stage": 2, "optimizer": adamw, "zc": {"overlap_comm": True}}))
    cases.append(("sgd-config-s2-w2", 2, {"stage": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.05,
                                                                                              "momentum": 0.9}}}))
    cases.append(("lion-config-s3-w2", 2, {"stage": 3, "optimizer": {"type": "Lion", "params": {"lr": 3e-3}}}))
    cases.append(("adagrad-config-s1-w2-offload", 2, {"stage": 1, "optimizer": {"type": "Adagrad",
                                                                                "params": {"lr": 0.05}},
                                                      "zc": off}))
    for client, stage, extra in (("client-rmsprop", 2, {}), ("client-sgd", 3, off), ("client-lion", 1, off),
                                 ("client-adagrad", 3, {}), ("client-adamw", 2, {})):
        cases.append((f"{client}-s{stage}-w2{'-offload' if extra else ''}", 2,
                      {"stage": stage, "client": client, "zc": extra}))
    for stage in (0, 1, 2, 3):
        cases.append((f"muon-s{stage}-w2", 2, {"stage": stage, "optimizer": muon, "model": "gpt"}))
    cases.append(("muon-s3-w3-offload", 3, {"stage": 3, "optimizer": muon, "model": "gpt", "zc": off}))
    cases.append(("muon-s2-w2-offload", 2, {"stage": 2, "optimizer": muon, "model": "gpt", "zc": off}))
    cases.append(("onebit-s2-w2", 2, {"stage": 2, "steps": 6, "optimizer": {
        "type": "OneBitAdam", "params": {"lr": 1e-2, "freeze_step": 3}}}))
    cases.append(("zeroone-s0-w2", 2, {"stage": 0, "steps": 6, "optimizer": {
        "type": "ZeroOneAdam", "params": {"lr": 1e-2, "var_freeze_step": 2, "var_update_scaler": 1,
                                          "local_step_scaler": 2, "local_step_clipper": 2}}}))
    return cases


def _helpers() -> list[tuple[str, int, str, str, tuple, dict]]:
    """(name, world, module, function, args, kwargs) of equivalence-test helpers whose returned
    numbers are recorded as they are."""
    return [
        ("tsbs-gpt-s3-w3-bf16", 3, "zero.testing.training", "train_side_by_side", (),
         dict(model="gpt", stage=3, precision="bf16", eps=1e-6)),
        ("tsbs-mlp-s2-w2-fp16-acc", 2, "zero.testing.training", "train_side_by_side", (),
         dict(model="mlp", stage=2, precision="fp16", accumulation=2, clip=0.5)),
        ("client-offload", 2, "test_client_optimizers", "_offloaded", ((0, 1, 2, 3),), {}),
        ("muon-errors", 2, "test_muon_zero", "_errors", ((0, 1, 2, 3),), {}),
        ("pipeline-1f1b-z1", 4, "test_parallelism", "train_pipeline", (2, "1f1b", 1, 3), {}),
        ("pipeline-gpipe-z2", 4, "test_parallelism", "train_pipeline", (2, "gpipe", 2, 3), {}),
        ("tensor-z3", 4, "test_parallelism", "train_tensor", (2, 3, 3), {}),
        ("sequence-s3", 2, "test_sequence_parallel", "_gpt_with_sequence_parallelism", (3, False), {}),
        ("sequence-s2-offload", 4, "test_sequence_parallel", "_gpt_with_sequence_parallelism", (2, True), {}),
    ]


def _call(module: str, function: str, args: tuple, kwargs: dict):
    import importlib

    return getattr(importlib.import_module(module), function)(*args, **kwargs)


def _plain(value):
    """JSON-able, with floats as exact hex strings."""
    import torch

    if isinstance(value, float):
        return value.hex()
    if isinstance(value, torch.Tensor):
        return _digest([value])
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def collect(only: str | None = None) -> dict:
    from zero.testing.dist import DistPool

    pools: dict[int, DistPool] = {}
    out: dict = {}

    def pool(world: int) -> DistPool:
        if world not in pools or pools[world].broken:
            pools[world] = DistPool(world)
        return pools[world]

    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name, world, case in _cases():
                if only and only not in name:
                    continue
                start = time.perf_counter()
                case = {**case, "dir": os.path.join(tmp, name)}
                try:
                    out[name] = _plain(pool(world).run(run_case, case, timeout=600))
                except Exception as exc:  # noqa: BLE001
                    out[name] = f"failed: {type(exc).__name__}: {str(exc)[-400:]}"
                print(f"{name}: {time.perf_counter() - start:.1f} s", flush=True)
            for name, world, module, function, args, kwargs in _helpers():
                if only and only not in name:
                    continue
                start = time.perf_counter()
                try:
                    out[name] = _plain(pool(world).run(_call, module, function, args, kwargs, timeout=600))
                except Exception as exc:  # noqa: BLE001
                    out[name] = f"failed: {type(exc).__name__}: {str(exc)[-400:]}"
                print(f"{name}: {time.perf_counter() - start:.1f} s", flush=True)
    finally:
        for p in pools.values():
            p.close()
    return out


def _diff(a, b, path: str, out: list[str]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                out.append(f"{path}/{k}: {'missing now' if k not in b else 'new'}")
            else:
                _diff(a[k], b[k], f"{path}/{k}", out)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            _diff(x, y, f"{path}[{i}]", out)
    elif a != b:
        out.append(f"{path}: {str(a)[:120]} -> {str(b)[:120]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=["save", "compare"])
    parser.add_argument("file")
    parser.add_argument("--only", help="run only the cases whose name contains this")
    args = parser.parse_args()
    got = collect(args.only)
    if args.action == "save":
        Path(args.file).write_text(json.dumps(got, indent=1, sort_keys=True))
        failed = [k for k, v in got.items() if isinstance(v, str) and v.startswith("failed")]
        print(f"saved {len(got)} cases to {args.file}" + (f"; failed: {failed}" if failed else ""))
        return 0
    want = json.loads(Path(args.file).read_text())
    if args.only:
        want = {k: v for k, v in want.items() if args.only in k}
    diffs: list[str] = []
    _diff(want, json.loads(json.dumps(got, sort_keys=True)), "", diffs)
    for d in diffs:
        print("DIFF", d)
    print(f"{len(got)} cases, {len(diffs)} difference(s)")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
