"""ZeroTrainer with `sequence_parallel_size` in its zero config (real transformers and accelerate, a
tiny Llama built here): 2 ranks sharing every sample, each with half of every sequence, train and
evaluate like one process with the whole sequences; bad settings are refused before anything changes."""
import tempfile

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install 'zero[hf]')")
pytest.importorskip("accelerate", reason="needs accelerate (pip install 'zero[hf]')")

import zero  # noqa: E402

SEQ, BATCH, STEPS = 15, 4, 3  # 15 tokens: the second rank's slice is padded; BATCH: the global batch


class Tokens(torch.utils.data.Dataset):
    """Sequences with a third of the labels ignored, unevenly: samples and slices count different
    numbers of valid tokens, so only a mean over the whole window's tokens matches one process."""

    def __init__(self, n: int = 32, seed: int = 0, ignored: bool = True):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(0, 64, (n, SEQ), generator=g)
        self.y = self.x.clone()
        if ignored:
            self.y[torch.rand(n, SEQ, generator=g) < 0.33] = -100
            self.y[::3, :9] = -100  # every third sample: almost nothing to learn in the first slice

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.y[i]}


def tiny(heads: int = 2, attention: str = "sdpa"):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=heads, head_dim=16, max_position_embeddings=16, bos_token_id=0, eos_token_id=1,
        pad_token_id=1, attn_implementation=attention))


def arguments(accumulation: int, **extra):
    # eps 1e-6: see [Note: conditioning of the comparison] in zero/testing/training.py
    return transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(), max_steps=STEPS, learning_rate=1e-3, adam_epsilon=1e-6, logging_steps=1,
        report_to=[], use_cpu=True, seed=0, dataloader_drop_last=True, train_sampling_strategy="sequential",
        save_strategy="no", lr_scheduler_type="constant", per_device_train_batch_size=BATCH // accumulation,
        gradient_accumulation_steps=accumulation, per_device_eval_batch_size=1, **extra)


def zero_config(stage: int, sequence_parallel_size: int = 1) -> dict:
    return {"sequence_parallel_size": sequence_parallel_size, "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "zero_optimization": {"stage": stage,
                                                                         "stage3_param_persistence_threshold": 0},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "eps": "auto", "weight_decay": "auto"}}}


# ZeRO 3 one micro-batch per step, tokens counted over all ranks (Trainer's default); ZeRO 2 two
# micro-batches per step, tokens counted over the sequence-parallel group (here the whole world)
RUNS = [(3, 1, {}), (2, 2, {"average_tokens_across_devices": False})]


def train(stage: int, accumulation: int, extra: dict, sequence_parallel_size: int) -> dict:
    from zero.integrations.hf import ZeroTrainer

    model = tiny()
    trainer = ZeroTrainer(model=model, args=arguments(accumulation, **extra), train_dataset=Tokens(),
                          eval_dataset=Tokens(8, seed=1, ignored=False), zero_config=zero_config(stage, sequence_parallel_size))
    trainer.train()
    history = trainer.state.log_history
    with zero.GatheredParameters(list(model.parameters())):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return dict(params=params, losses=[h["loss"] for h in history if "loss" in h],
                norms=[h["grad_norm"] for h in history if "grad_norm" in h], eval_loss=trainer.evaluate()["eval_loss"],
                attention=model.config._attn_implementation, steps=trainer.engine.global_steps)


def refusal(model, config: dict) -> str:
    from zero.integrations.hf import ZeroTrainer

    try:
        ZeroTrainer(model=model, args=arguments(1), train_dataset=Tokens(), zero_config=config)
    except ValueError as exc:
        return str(exc)
    return "no error"


def on_ranks() -> dict:
    runs = [train(stage, accumulation, extra, dist.get_world_size()) for stage, accumulation, extra in RUNS]
    three_heads, eager = tiny(heads=3), tiny(attention="eager")
    return dict(runs=runs, too_many=refusal(three_heads, zero_config(3, 4)), eager=refusal(eager, zero_config(3, 2)),
                untouched=[three_heads.config._attn_implementation, eager.config._attn_implementation])


def test_zero_trainer_with_sequence_parallel_size_trains_like_the_whole_sequences_in_one_process(dist_run):
    results = dist_run(2, on_ranks, timeout=600)
    references = [train(stage, accumulation, extra, 1) for stage, accumulation, extra in RUNS]
    for rank, result in enumerate(results):
        for (stage, _, _), run, reference in zip(RUNS, result["runs"], references):
            error = max(((run["params"][n] - p).abs().max() / p.abs().max()).item()
                        for n, p in reference["params"].items())
            assert error < 1e-5, (stage, rank, error)
            assert len(run["losses"]) == STEPS and run["losses"] == pytest.approx(reference["losses"], rel=1e-5)
            assert run["norms"] == pytest.approx(reference["norms"], rel=1e-5)
            # evaluation runs whole sequences with the model's own attention, which it keeps after train();
            # all its labels count: Trainer weighs data-parallel ranks' eval batches by their tokens
            assert run["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-5)
            assert run["attention"] == "sdpa" and run["steps"] == STEPS
        message = result["too_many"]
        assert message.startswith("ZeroTrainer: zero_config sequence_parallel_size is 4, but "), message
        assert "it does not divide the world of 2 ranks" in message
        assert "the model's 3 attention heads (config.num_attention_heads) do not split over 4 ranks" in message
        assert "the model's 3 key/value heads (config.num_key_value_heads) neither split over nor divide 4" in message
        assert "attention implementation 'eager' cannot be wrapped" in result["eager"]
        assert result["untouched"] == ["sdpa", "eager"]  # refused before anything changed
    from zero.integrations.hf import ZeroTrainer

    with pytest.raises(ValueError, match="ZeroTrainer trains with ZeRO data parallelism only, but the config asks "
                                         "for tensor_parallel.size 2"):
        ZeroTrainer(model=tiny(), args=arguments(1), train_dataset=Tokens(),
                    zero_config={**zero_config(3, 2), "tensor_parallel": {"size": 2}})
