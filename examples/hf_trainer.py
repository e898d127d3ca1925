"""HuggingFace Trainer on zero: a small Llama trained on generated text with ZeRO-3.

    torchrun --nproc_per_node 2 examples/hf_trainer.py [--stage 3] [--offload] [--steps 30]

Runs on CPU (gloo) or GPUs (NCCL). The zero config is HuggingFace's own ZeRO-3 example with "auto"
values, which ZeroTrainer fills from the TrainingArguments. After training it saves a checkpoint
(resumable on any number of ranks: `--resume out/hf_trainer/checkpoint-N`), the model for
`from_pretrained`, evaluates, and generates on every rank.
"""
from __future__ import annotations

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from zero.integrations.hf import ZeroTrainer


class Arithmetic(torch.utils.data.Dataset):
    """Token sequences that count up by a per-sequence step modulo the vocabulary: learnable."""

    def __init__(self, n: int, length: int = 32, vocab: int = 128, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        step = torch.randint(1, 5, (n, 1), generator=g)
        self.x = (start + step * torch.arange(length)) % vocab

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--offload", action="store_true", help="optimizer states and Adam in CPU memory")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--out", default="out/hf_trainer")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32,
                                         bos_token_id=0, eos_token_id=1, pad_token_id=1))
    zero_config = {  # HuggingFace's ZeRO-3 example, as published
        "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                          "warmup_num_steps": "auto", "total_num_steps": "auto"}},
        "zero_optimization": {"stage": args.stage, "overlap_comm": True, "reduce_bucket_size": "auto",
                              "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                              "stage3_gather_16bit_weights_on_model_save": True},
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
    }
    if args.offload:
        zero_config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    training_args = TrainingArguments(
        output_dir=args.out, per_device_train_batch_size=8, gradient_accumulation_steps=2, max_steps=args.steps,
        learning_rate=3e-3, warmup_steps=3, logging_steps=5, save_steps=args.steps, report_to=[],
        use_cpu=not torch.cuda.is_available(), seed=0)
    trainer = ZeroTrainer(model=model, args=training_args, train_dataset=Arithmetic(2048),
                          eval_dataset=Arithmetic(64, seed=1), zero_config=zero_config)
    result = trainer.train(resume_from_checkpoint=args.resume)
    metrics = trainer.evaluate()
    trainer.save_model(f"{args.out}/final")
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    prompt = Arithmetic(1, length=4 + rank, seed=2 + rank).x  # ranks have different prompts and lengths
    out = model.generate(prompt.to(trainer.args.device), max_new_tokens=6 + 2 * rank, do_sample=False,
                         eos_token_id=None)
    if trainer.is_world_process_zero():
        print(f"train loss {result.training_loss:.3f}  eval loss {metrics['eval_loss']:.3f}  "
              f"steps {trainer.state.global_step}")
    print(f"rank {rank}: prompt {prompt.tolist()[0]} -> {out.tolist()[0][prompt.shape[1]:]}", flush=True)


if __name__ == "__main__":
    main()
