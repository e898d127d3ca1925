"""ZeRO-R activation checkpoints (zero.activations, deepspeed.checkpointing): partitioned over the
model-parallel group and kept in host memory, with the numbers of plain checkpointing."""
from __future__ import annotations

import torch
import torch.nn.functional as F


class _Blocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(3))

    def forward(self, x, checkpoint=None):
        for layer in self.layers:
            f = lambda t, m=layer: F.gelu(m(t))  # noqa: E731
            x = checkpoint(f, x) if checkpoint is not None else f(x)
        return x.square().mean()


def _zero_r_equals_plain():
    import torch.distributed as dist

    from zero import activations
    from zero.deepspeed import checkpointing

    class _Mpu:  # the tensor-parallel group: its ranks hold the same hidden states
        def get_model_parallel_group(self):
            return dist.group.WORLD

    x = torch.randn(4, 7, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)  # 896: not even
    results = {}
    for mode in ("plain", "torch", "zero-r"):
        model = _Blocks()
        xi = x.detach().clone().requires_grad_()
        if mode == "zero-r":
            checkpointing.configure(_Mpu(), partition_activations=True, checkpoint_in_cpu=True)
        loss = model(xi, None if mode == "plain" else checkpointing.checkpoint)
        loss.backward()
        results[mode] = [xi.grad, *(p.grad for p in model.parameters())]
        checkpointing.configure(partition_activations=False, checkpoint_in_cpu=False)
    errors = [max((a - b).abs().max().item() for a, b in zip(results["plain"], results[m])) for m in ("torch", "zero-r")]
    activations.configure(partition_activations=True)
    kept = activations.kept_bytes([x])
    activations.configure(partition_activations=False)
    return errors, kept, x.numel() * 4


def test_partitioned_and_host_checkpoints_give_the_numbers_of_plain_ones(dist_run):
    for errors, kept, whole in dist_run(2, _zero_r_equals_plain):
        assert max(errors) < 1e-6, errors
        assert kept == whole // 2, (kept, whole)  # each of 2 ranks keeps half of the checkpointed input


def test_the_config_section_switches_zero_r_on():
    import zero
    from zero import activations

    try:
        engine, *_ = zero.initialize(model=_Blocks(), config={
            "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"},
            "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True}})
        assert activations.settings.partition and activations.settings.cpu
        x = torch.randn(2, 32, requires_grad=True)
        engine.backward(engine(x, activations.checkpoint))  # one rank: kept whole, in host memory already
        engine.step()
        engine.destroy()
    finally:
        activations.configure(partition_activations=False, checkpoint_in_cpu=False)
