"""Train a small GPT with ZeRO stage 2 across ranks: the main demo of `zero`.

    torchrun --nproc_per_node 2 examples/train_zero2.py [--steps 200] [--stage 2] [--bf16]
    torchrun --nproc_per_node 2 examples/train_zero2.py --stage 3   # parameters sharded too
    torchrun --nproc_per_node 2 examples/train_zero2.py --offload   # optimizer on the CPU (ZeRO-Offload)

Works the same on one process (`python examples/train_zero2.py`), on CPUs (gloo) and on GPUs
(NCCL). The text is sums like '12+7=19;' generated in-process, so nothing is downloaded; the
model learns them well below the loss of uniform guessing (printed as the baseline). At the end
rank 0 prints the per-rank model-state memory against the ZeRO formula and the communication
of the last step.
"""
from __future__ import annotations

import argparse
import math
import time

import torch

import zero
from zero.testing.models import GPT, CharDataset, GPTConfig, arithmetic_corpus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3])
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--offload", action="store_true", help="optimizer state and update on the CPU")
    args = parser.parse_args()

    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.accumulation,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": args.steps, "warmup_num_steps": 20}},
        "zero_optimization": {"stage": args.stage, "reduce_bucket_size": 50_000, "overlap_comm": True,
                              # stage 3: one unit per transformer block, LayerNorm params kept whole
                              "stage3_module_granularity_threshold": 20_000, "stage3_param_persistence_threshold": 1_000,
                              **({"offload_optimizer": {"device": "cpu", "pin_memory": True}} if args.offload else {})},
        "bf16": {"enabled": args.bf16},
        "dataloader_drop_last": True,
    }
    torch.manual_seed(0)
    data = CharDataset(arithmetic_corpus(400_000), block_size=32)
    model = GPT(GPTConfig(vocab_size=data.vocab_size, block_size=32, n_layer=2, n_head=4, n_embd=64))
    n_params = sum(p.numel() for p in model.parameters())  # before stage 3 shards them
    engine, _, loader, _ = zero.initialize(model=model, config=config, training_data=data)
    rank = engine.comm.rank
    if rank == 0:
        print(f"ZeRO stage {args.stage} on {engine.world_size} rank(s), {engine.device}; GPT with "
              f"{n_params:,} parameters; uniform-guess loss {math.log(data.vocab_size):.3f}")

    start, epoch = time.perf_counter(), 0
    batches = iter(loader)
    while engine.global_steps < args.steps:
        try:
            x, y = next(batches)
        except StopIteration:
            epoch += 1
            loader.sampler.set_epoch(epoch) if hasattr(loader.sampler, "set_epoch") else None
            batches = iter(loader)
            continue
        loss = engine(x.to(engine.device), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        if rank == 0 and engine.is_gradient_accumulation_boundary() and engine.global_steps % 25 == 0:
            ms = (time.perf_counter() - start) / engine.global_steps * 1e3
            print(f"step {engine.global_steps:4d}  loss {loss.item():.3f}  lr {engine.get_lr()[0]:.2e}  "
                  f"grad norm {engine.get_global_grad_norm():.3f}  ({ms:.0f} ms/step)", flush=True)
    if rank == 0:
        mem = engine.memory_report()
        psi = sum(p._zero.numel if getattr(p, "_zero", None) else p.numel() for p in engine.optimizer.params)
        n = engine.world_size
        p16 = 2 if args.bf16 else 4  # bytes of a parameter and of a gradient
        master = 4 if args.bf16 or args.offload else 0  # fp32 training without offload: params are the master
        shard = {1: (p16 * psi, p16 * psi), 2: (p16 * psi, p16 * psi / n)}.get(args.stage, (p16 * psi / n, p16 * psi / n))
        formula = shard[0] + shard[1] + (master + 8) * psi / n  # ZeRO paper, stages 1-3 (padding aside)
        formula += p16 * mem.get("persistent_params", 0)  # stage 3 keeps small parameters whole
        print(f"final loss {loss.item():.3f}")
        print(f"model-state bytes per rank: {mem['model_states_total']:,} measured, {formula:,.0f} by the ZeRO formula")
        print(f"last step's collectives: {engine.comm_report()}")


if __name__ == "__main__":
    main()
