"""The estimator's activations (zero/estimate/activations.py) against the allocator: the trace of one
forward and backward counts what plain PyTorch allocates, and a training step's peak under ZeRO
(model states + buffers + activations, as the end table shows it) is within 10% of the peak
measured at the allocator, for a GPT, an HF Llama and a 3D U-Net at three sequence lengths each."""
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import zero
from zero.estimate import estimate_activations, estimate_memory
from zero.models import GPT, GPTConfig
from zero.probes import AllocatorPeak

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


def unet(width: int = 8) -> nn.Module:
    from zero.models import UNet3D

    return UNet3D(width=width)


def llama(checkpointing: bool = False) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=4096, use_cache=False)
    model = LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")
    if checkpointing:
        model.gradient_checkpointing_enable()
    return model.train()


def gpt() -> nn.Module:
    return GPT(GPTConfig(vocab_size=512, block_size=4096, n_layer=3, n_head=4, n_embd=64))


def plain_peak(model: nn.Module, args: tuple, kwargs: dict, loss) -> int:
    """What one forward and backward of plain PyTorch adds at the allocator, each gradient handed on
    as the engine does (dropped here)."""
    handles = [p.register_post_accumulate_grad_hook(lambda q: setattr(q, "grad", None)) for p in model.parameters()]
    with AllocatorPeak() as peak:
        value = loss(model(*args, **kwargs))
        value.backward()
        del value
    for h in handles:
        h.remove()
    return peak.peak


def test_the_trace_counts_what_pytorch_allocates():
    pytest.importorskip("transformers")
    warnings.filterwarnings("ignore", message=".*use_cache.*")
    torch.manual_seed(0)
    cases = []
    for T in (256, 1024):
        ids = torch.randint(0, 256, (1, T))
        cases.append(("gpt", gpt(), (ids, ids), {}, None))
        cases.append(("llama", llama(), (), {"input_ids": ids, "labels": ids}, None))
        cases.append(("llama, checkpointed", llama(checkpointing=True), (), {"input_ids": ids, "labels": ids}, None))
    for edge in (16, 24):  # convolutions' scratch memory is measured per signature, at edge 16
        cases.append(("unet", unet(), (torch.randn(2, 1, edge, edge, edge),), {}, lambda out: out.float().sum()))
    for name, model, args, kwargs, loss in cases:
        est = estimate_activations(model, (args, kwargs), loss=loss)
        real = plain_peak(model, args, kwargs, loss or (lambda out: out if torch.is_tensor(out) else out.loss))
        assert abs(est.peak / real - 1) < 0.02, (name, est, real)
        assert 0 < est.saved <= est.peak, (name, est)
    # checkpointing keeps less, and the estimate sees it; a bf16 trace is about half the fp32 one
    ids = torch.zeros(1, 1024, dtype=torch.long)
    plain, ckpt = (estimate_activations(m, micro_batch_size=1, seq_len=1024) for m in (llama(), llama(True)))
    assert ckpt.saved < 0.5 * plain.saved, (plain, ckpt)
    half = estimate_activations(llama(), micro_batch_size=1, seq_len=1024, dtype=torch.bfloat16)
    assert 0.4 < half.peak / plain.peak < 0.75, (half, plain)
    # sequence parallelism over 4 (stand-in) ranks: each rank's quarter of the sequence
    quarter = estimate_activations(gpt(), micro_batch_size=1, seq_len=1024, sequence_parallel_size=4)
    whole = estimate_activations(gpt(), micro_batch_size=1, seq_len=1024)
    assert 0.2 < quarter.peak / whole.peak < 0.4, (quarter, whole)
    # the parameters are untouched, and bad input is named
    model = gpt()
    before = [p.detach().clone() for p in model.parameters()]
    estimate_activations(model, (ids, ids))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with pytest.raises(ValueError, match="seq_len"):
        estimate_activations(model)
    with pytest.raises(ValueError, match="does not split over sequence_parallel_size 3"):
        estimate_activations(model, seq_len=1024, sequence_parallel_size=3)
    with pytest.raises(ValueError, match="pass example"):
        estimate_activations(unet(), seq_len=16)
    with pytest.raises(TypeError, match="ActivationEstimate"):
        estimate_memory(model, 2, activations="1 GB")


def train_and_report(kind: str, size: int, stage: int, offload: bool) -> dict:
    """A few steps under zero with the TrainingMonitor; its measured and estimated peaks."""
    torch.manual_seed(0)
    model = {"gpt": gpt, "llama": llama, "unet": unet}[kind]()
    zc = {"stage": stage, **({"offload_optimizer": {"device": "cpu"}} if offload else {}),
          **({"stage3_module_granularity_threshold": 20_000, "stage3_param_persistence_threshold": 1_000}
             if stage == 3 else {"reduce_bucket_size": 50_000})}
    engine, *_ = zero.initialize(model=model, config={"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"},
                                                      "zero_optimization": zc})
    monitor = zero.TrainingMonitor(engine, steps=3)
    g = torch.Generator().manual_seed(engine.comm.rank)
    for _ in range(3):
        if kind == "unet":
            x = torch.randn(2, 1, size, size, size, generator=g)
            loss = engine(x).float().sum()
        else:
            ids = torch.randint(0, 256, (2, size), generator=g)
            loss = engine(ids, ids) if kind == "gpt" else engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        monitor.step(loss)
    text = monitor.report()
    return {"predicted": monitor.summary.get("predicted_peak"), "measured": monitor.summary.get("step_peak"),
            "text": text, "activations": monitor.summary.get("activations")}


@pytest.mark.parametrize("kind,sizes,stage,offload", [
    ("gpt", (128, 512, 1024), 3, False),
    ("llama", (128, 512, 1024), 2, True),
    ("unet", (8, 16, 24), 3, True),
])
def test_the_estimated_peak_of_a_step_is_within_ten_percent_of_the_allocator(dist_run, kind, sizes, stage, offload):
    if kind == "llama":
        pytest.importorskip("transformers")
    activations = []
    for size in sizes:
        report = dist_run(2, train_and_report, kind, size, stage, offload)[0]
        assert "peak, estimated (+ activations)" in report["text"] and "measured (allocator)" in report["text"]
        for measured in report["measured"]:
            assert abs(report["predicted"] / measured - 1) <= 0.10, (kind, size, report["predicted"], measured)
        activations.append(report["activations"].peak)
    assert activations == sorted(activations) and activations[-1] > 4 * activations[0], activations


def test_the_command_line_prints_the_peak_with_activations(tmp_path, capsys):
    pytest.importorskip("transformers")
    from zero.estimate import format_bytes
    from zero.estimate.__main__ import main

    model = llama(checkpointing=True)
    model.config.save_pretrained(tmp_path)
    main(["--model", str(tmp_path), "--gpus", "2", "--stage", "3", "--offload", "none", "--dtype", "fp32",
          "--seq-len", "512", "--checkpointing", "--sequence-parallel", "2"])
    out = capsys.readouterr().out
    act = estimate_activations(model, micro_batch_size=1, seq_len=512, sequence_parallel_size=2)
    assert "peak/rank" in out and f"activations ({format_bytes(act.peak)}," in out, out
    row = estimate_memory(model, 2, stage=3, offload="none", dtype="fp32", activations=act)[0]
    assert format_bytes(row.peak_bytes) in out.splitlines()[3], out
    for bad in (["--sequence-parallel", "3"], ["--seq-len", "64", "--params", "1e6"]):
        args = ["--gpus", "2", *bad] + (["--model", str(tmp_path)] if "--params" not in bad else [])
        with pytest.raises(SystemExit):
            main(args)
    assert "--sequence-parallel 3 must divide the 2 ranks" in capsys.readouterr().err
