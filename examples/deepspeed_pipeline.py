"""A DeepSpeed pipeline-parallel training script, written from DeepSpeed's documented API; the only
change for zero is the import below (`import deepspeed` -> `import zero.deepspeed as deepspeed`).

    torchrun --nproc_per_node 4 examples/deepspeed_pipeline.py --deepspeed_config cfg.json

It builds the model as a list of LayerSpec entries split into two stages, lets
`deepspeed.initialize` wrap it with the training data, and calls `engine.train_batch()` once per
step; the config's ZeRO stage partitions each stage's optimizer state over its data-parallel ranks.
"""
import argparse
import json
import os
import tempfile

import torch
import torch.nn as nn

import zero.deepspeed as deepspeed  # was: import deepspeed
from zero.deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec  # was: from deepspeed.pipe import ...
from zero.deepspeed.utils import RepeatingLoader  # was: from deepspeed.utils import RepeatingLoader


class Embed(nn.Module):
    def __init__(self, vocab: int, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, width) * 0.1)

    def forward(self, tokens):
        return self.weight[tokens].mean(dim=1)  # a bag of tokens


class Residual(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.relu(self.fc(x))


def tied_head(embed: Embed, x):
    return x @ embed.weight.t()  # the output layer shares the embedding's weight


class Tokens(torch.utils.data.Dataset):
    """Bags of 6 tokens; the label is the most frequent token below 8 (a learnable task)."""

    def __init__(self, n: int, vocab: int):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, vocab, (n, 6), generator=g)
        self.y = torch.stack([torch.bincount(row.clamp(max=8), minlength=9)[:8].argmax() for row in self.x])

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def get_args():
    parser = argparse.ArgumentParser(description="pipeline-parallel training")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--pipeline-parallel-size", "--pp", type=int, default=2)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def main(args=None):
    args = args or get_args()
    if not getattr(args, "deepspeed_config", None):  # a default config, written once per run
        config = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                  "optimizer": {"type": "Adam", "params": {"lr": 3e-3}},
                  "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0, "steps_per_print": 10}
        path = os.path.join(tempfile.gettempdir(), f"pipeline_example_{os.getpid()}.json")
        with open(path, "w") as f:
            json.dump(config, f)
        args.deepspeed_config = path
    deepspeed.init_distributed()
    vocab, width = 16, 32
    layers = [TiedLayerSpec("embed", Embed, vocab, width),
              *[LayerSpec(Residual, width) for _ in range(4)],
              TiedLayerSpec("embed", Embed, vocab, width, forward_fn=tied_head)]
    net = PipelineModule(layers=layers, loss_fn=nn.CrossEntropyLoss(), num_stages=args.pipeline_parallel_size,
                         partition_method="parameters", seed_layers=True)
    engine, _, loader, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
        training_data=Tokens(2048, vocab))
    data = iter(RepeatingLoader(loader))
    losses = []
    for _ in range(args.steps):
        losses.append(engine.train_batch(data_iter=data).item())
    if torch.distributed.get_rank() == 0:
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {args.steps} steps")
    return losses


if __name__ == "__main__":
    main()
