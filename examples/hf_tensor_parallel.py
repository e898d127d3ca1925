"""HuggingFace GPT-2 sliced over tensor-parallel ranks, ZeRO over the data-parallel ones.

    torchrun --nproc_per_node 4 examples/hf_tensor_parallel.py [--tensor 2] [--stage 3] [--steps 60]

The config's `tensor_parallel.size` (DeepSpeed's `autotp_size`) makes `zero.initialize` slice the
unsliced model by zero's "gpt2" plan: attention by heads (the fused q/k/v `c_attn` per head), the
MLP by its inner width, the vocabulary in the tied embedding and head; ZeRO then shards each
rank's pieces over the data-parallel ranks (`engine.comm`). The ranks of one tensor group must
be fed the same batches, so the batch is split by data rank. After training it saves a
checkpoint, consolidates it (`get_fp32_state_dict`, the q/k/v columns back in HF's order) into a
plain GPT2LMHeadModel, and checks that the plain model continues a prompt as the sliced one does.
Runs on CPU (gloo) or GPUs (NCCL). See docs/parallelism.md.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel

import zero
from zero.checkpoint.consolidate import get_fp32_state_dict


def counting(rows: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    """Sequences that count up by a per-sequence step modulo the vocabulary: learnable."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (rows, 1), generator=g)
    step = torch.randint(1, 5, (rows, 1), generator=g)
    return (start + step * torch.arange(length)) % vocab


def model_config() -> GPT2Config:
    # 101 tokens: the tensor ranks need not divide the vocabulary (GPT-2's own is 50257)
    return GPT2Config(vocab_size=101, n_positions=32, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=1)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tensor", type=int, default=2, help="tensor-parallel ranks T (world = T x data ranks)")
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rows", type=int, default=8, help="sequences per data rank per step")
    parser.add_argument("--out", default="out/hf_tensor_parallel")
    args = parser.parse_args(argv)

    torch.manual_seed(0)  # every rank alike: dropout in the sliced model draws the same masks on a tensor group
    model = GPT2LMHeadModel(model_config())
    config = {"train_micro_batch_size_per_gpu": args.rows, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
              "tensor_parallel": {"autotp_size": args.tensor}, "zero_optimization": {"stage": args.stage}}
    engine, *_ = zero.initialize(model=model, config=config)
    data_rank, data_ranks = engine.comm.rank, engine.comm.world_size
    vocab = model.config.vocab_size
    losses = []
    for step in range(args.steps):
        x = counting(args.rows * data_ranks, 32, vocab, seed=step)[data_rank * args.rows : (data_rank + 1) * args.rows]
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if step % 10 == 0 and dist.get_rank() == 0:
            print(f"step {step:3d}  loss {loss.item():.3f}", flush=True)

    engine.save_checkpoint(args.out)
    prompt = counting(2, 6, vocab, seed=10_000)
    engine.module.eval()
    with torch.no_grad(), zero.GatheredParameters(list(engine.module.parameters())):
        sliced = engine.module.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=1)
    plain = GPT2LMHeadModel(model_config())  # the consolidated checkpoint, in HF's own layout
    plain.load_state_dict(get_fp32_state_dict(args.out), strict=False)  # strict=False: lm_head is wte, tied
    with torch.no_grad():
        whole = plain.eval().generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=1)
    if dist.get_rank() == 0:
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; mesh {engine.memory_report()['mesh']['shape']}")
        print(f"prompt {prompt[0].tolist()} -> sliced {sliced[0, 6:].tolist()}, consolidated {whole[0, 6:].tolist()}")
    return {"rank": dist.get_rank(), "losses": losses, "sliced": sliced.tolist(), "whole": whole.tolist()}


if __name__ == "__main__":
    main()
