"""`to-fp32` and `get_fp32_state_dict`: a plain state dict from a checkpoint of any stage, equal to
the gathered parameters, loadable into the plain model; tied parameters saved once."""
import subprocess
import sys

import pytest
import torch

import zero
from zero.checkpoint.consolidate import get_fp32_state_dict, load_sharded_safetensors, to_fp32
from zero.testing.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=18)  # tied embedding and head


def save_gpt(stage: int, path: str):
    torch.manual_seed(0)
    zc = {"stage": stage}
    if stage == 3:
        zc.update(stage3_param_persistence_threshold=20, stage3_module_granularity_threshold=500)
    engine, *_ = zero.initialize(model=GPT(CFG), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"}, "bf16": {"enabled": True},
        "zero_optimization": zc})
    idx = torch.randint(0, 37, (2, 9), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        engine.backward(engine(idx[:, :-1], idx[:, 1:]))
        engine.step()
    engine.save_checkpoint(path)
    masters = {}
    with zero.GatheredParameters(list(engine.module.parameters())):
        for name, p in engine.module.named_parameters():
            masters[name] = p.detach().float().clone()
    return masters


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_to_fp32_gives_the_plain_model_its_weights(dist_run, tmp_path, stage):
    gathered = dist_run(2, save_gpt, stage, str(tmp_path / "ckpt"))[0]
    state = get_fp32_state_dict(tmp_path / "ckpt")
    plain = GPT(CFG)
    plain.load_state_dict(state, strict=True)  # every key, tied ones included
    for name, p in plain.named_parameters():  # the fp32 master rounds to the bf16 parameters
        assert torch.equal(p.detach().bfloat16().float(), gathered[name]), name
        assert p.dtype == torch.float32
    files = to_fp32(tmp_path / "ckpt", tmp_path / "out", max_shard_size="8KB")
    assert len(files) > 2 and files[-1].endswith("model.safetensors.index.json")
    written = load_sharded_safetensors(tmp_path / "out")
    missing, unexpected = GPT(CFG).load_state_dict(written, strict=False)
    assert unexpected == [] and missing == ["head.weight"]  # the tied head is saved once, as HuggingFace does
    assert all(torch.equal(written[k], state[k]) for k in written)


def test_the_command_line(tmp_path, dist_run):
    dist_run(2, save_gpt, 2, str(tmp_path / "ckpt"))
    run = subprocess.run([sys.executable, "-m", "zero.checkpoint", "to-fp32", str(tmp_path / "ckpt"),
                          str(tmp_path / "out"), "--dtype", "bf16"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    written = load_sharded_safetensors(tmp_path / "out")
    assert written["wte.weight"].dtype == torch.bfloat16
    bad = subprocess.run([sys.executable, "-m", "zero.checkpoint", "to-fp32", str(tmp_path / "nowhere"),
                          str(tmp_path / "x")], capture_output=True, text=True)
    assert bad.returncode == 2 and "checkpoint directory" in bad.stderr and "does not exist" in bad.stderr


def save_16bit(path: str):
    torch.manual_seed(0)
    engine, *_ = zero.initialize(model=GPT(CFG), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"}, "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True,
                              "stage3_param_persistence_threshold": 20}})
    engine.save_16bit_model(path)
    with zero.GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def test_save_16bit_model_writes_safetensors_by_default(dist_run, tmp_path):
    from safetensors.torch import load_file

    gathered = dist_run(2, save_16bit, str(tmp_path))[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    state = load_file(str(tmp_path / "model.safetensors"))
    missing, unexpected = GPT(CFG).to(torch.bfloat16).load_state_dict(state, strict=False)
    assert missing == ["head.weight"] and unexpected == []  # tied: saved once
    assert all(torch.equal(state[n], gathered[n]) for n in state if n in gathered)


MAKE = """
import sys, torch, torch.nn as nn, zero
torch.manual_seed(0)
frozen = [nn.Linear(2048, 2048, bias=False) for _ in range(20)]  # 16 MB each, 320 MB in all
for m in frozen:
    m.requires_grad_(False)
model = nn.Sequential(*frozen, nn.Linear(2048, 2))
engine, *_ = zero.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1,
                                                  "optimizer": {"type": "AdamW"}})
engine.save_checkpoint(sys.argv[1])
"""

CONVERT = """
import resource, sys
from zero.checkpoint.consolidate import to_fp32
import safetensors.torch, torch.distributed.checkpoint  # imports before the baseline
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
files = to_fp32(sys.argv[1], sys.argv[2], max_shard_size="32MB")
print(len(files), (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


def test_to_fp32_memory_stays_at_the_largest_tensor_plus_one_shard(tmp_path):
    subprocess.run([sys.executable, "-c", MAKE, str(tmp_path / "ckpt")], check=True, capture_output=True)
    run = subprocess.run([sys.executable, "-c", CONVERT, str(tmp_path / "ckpt"), str(tmp_path / "out")],
                         check=True, capture_output=True, text=True)
    files, grew = map(int, run.stdout.split())
    assert files == 21  # 20 shards of one 16.8 MB tensor each (32 MB holds one), the head in the last, the index
    assert grew < 160e6, grew  # 320 MB of tensors; bound: ~3 x 16 MB (read, assembled) + 2 x 32 MB (a shard)
