"""Train a 3D U-Net to segment blobs in synthetic volumes with ZeRO stage 3 and CPU optimizer offload.

    torchrun --nproc_per_node 2 examples/train_unet3d.py                     # 32^3 volumes, stage 3 + offload
    torchrun --nproc_per_node 2 examples/train_unet3d.py --size 64 --width 32 --steps 300
    torchrun --nproc_per_node 2 examples/train_unet3d.py --config examples/configs/zero2.json
    torchrun --nproc_per_node 4 examples/train_unet3d.py --spatial 4 --spatial-dims 2 3   # each volume on a 2x2 grid

For the 3D-imaging case whose networks do not fit one device: under stage 3 each rank holds 1/N of
the parameters, gradients and (here, in host memory) the optimizer state, and gathers one block of
the network at a time. The volumes are generated on the fly (noisy spheres of random size and
place, nothing downloaded), the target is their mask, the loss is Dice + binary cross-entropy.
Rank 0 shows the progress bar and, at the end, the same table as examples/train_gpt.py: memory per
rank measured and estimated, what every other stage would need, communication and time per step.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

import zero
import zero.spatial
from zero.models import UNet3D  # noqa: F401  (the network; tests load it from here too)

CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 1e-4}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "stage3_param_persistence_threshold": 2_000,  # norms and biases stay whole
                          "stage3_module_granularity_threshold": 20_000},  # about one conv block per unit
    "wall_clock_breakdown": True,
}


def blobs(batch: int, size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy volumes with 1-3 spheres each, and their masks."""
    grid = torch.stack(torch.meshgrid(*[torch.arange(size, dtype=torch.float32)] * 3, indexing="ij"))
    masks = torch.zeros(batch, 1, size, size, size)
    for b in range(batch):
        for _ in range(int(torch.randint(1, 4, (1,), generator=generator))):
            centre = torch.rand(3, generator=generator) * size * 0.6 + size * 0.2
            radius = float(torch.rand(1, generator=generator)) * size * 0.15 + size * 0.08
            inside = ((grid - centre.view(3, 1, 1, 1)) ** 2).sum(0) < radius**2
            masks[b, 0][inside] = 1.0
    volumes = masks * 0.7 + 0.35 * torch.randn(masks.shape, generator=generator)
    return volumes, masks


def dice(logits: torch.Tensor, target: torch.Tensor, spatial: bool = False) -> torch.Tensor:
    """The Dice score; over a volume split across spatial ranks, of the whole volume (on every rank)."""
    prob = torch.sigmoid(logits.float())
    total = zero.spatial.volume_sum if spatial else torch.sum
    return (2 * total(prob * target) + 1) / (total(prob) + total(target) + 1)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, help="a DeepSpeed-style config (default: stage 3 + CPU optimizer offload)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--size", type=int, default=32, help="volume edge in voxels (a multiple of 4)")
    parser.add_argument("--width", type=int, default=16, help="channels of the top level")
    parser.add_argument("--spatial", type=int, default=1,
                        help="ranks each volume is split over (spatial_parallel_size; docs/spatial.md)")
    parser.add_argument("--spatial-dims", type=int, nargs="+", default=[2],
                        help="the dimensions split: 2 (depth slabs, the default), or 2 3 / 2 3 4 (blocks of a grid)")
    args = parser.parse_args(argv)
    config = json.loads(args.config.read_text()) if args.config else dict(CONFIG)
    if args.spatial > 1:
        config["spatial_parallel_size"] = args.spatial
        config["spatial_parallel_dims"] = args.spatial_dims
    config.pop("scheduler", None)  # the GPT configs' schedule is for another run length

    zero.init_distributed()
    torch.manual_seed(0)
    model = UNet3D(width=args.width)
    engine, *_ = zero.initialize(model=model, config=config)
    rank, world = engine.comm.rank, engine.world_size
    micro = engine.config.train_micro_batch_size_per_gpu
    dtype = engine.config.dtype
    if rank == 0:
        n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
        print(f"zero: 3D U-Net with {n_params:,} parameters, {args.size}^3 volumes, {world} rank(s), {engine.device}",
              flush=True)
    monitor = zero.TrainingMonitor(engine, steps=args.steps, tokens_per_step=engine.config.train_batch_size * args.size**3,
                                   unit="vox")
    spatial = args.spatial > 1
    # each data-parallel rank its own volumes; the ranks of a spatial group the same ones, each its slab
    generator = torch.Generator().manual_seed(1000 + (rank // args.spatial))
    losses, scores = [], []
    while engine.global_steps < args.steps:
        x, y = blobs(micro, args.size, generator)
        x, y = x.to(engine.device, dtype), y.to(engine.device)
        if spatial:
            x, y = zero.spatial.shard_volume(x), zero.spatial.shard_volume(y)
        logits = engine(x)
        score = dice(logits, y, spatial)
        bce = F.binary_cross_entropy_with_logits(logits.float(), y, reduction="none")
        loss = 1 - score + (zero.spatial.volume_mean(bce) if spatial else bce.mean())
        engine.backward(loss)
        engine.step()
        monitor.step(loss)
        losses.append(loss.item())
        scores.append(score.item())
    table = monitor.report()
    if rank == 0:
        print(table, end="")
        first, last = scores[:5], scores[-10:]
        print(f"Dice on the training volumes: {sum(first) / len(first):.3f} over the first {len(first)} micro-steps, "
              f"{sum(last) / len(last):.3f} over the last {len(last)}")
    return {"first_loss": losses[0], "final_loss": sum(losses[-10:]) / len(losses[-10:]),
            "dice": sum(scores[-10:]) / len(scores[-10:]), "table": table, "summary": monitor.summary,
            "memory": engine.memory_report(), "rank": rank}


if __name__ == "__main__":
    main()
