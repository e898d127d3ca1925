"""The elasticity section's arithmetic (zero/config/elasticity.py): the batch it chooses, what each world
size trains with, and the errors. The restarts themselves: tests/test_auto_resume.py."""
import logging

import pytest

from zero.config import ConfigError, load_config
from zero.config.elasticity import compute_elastic_config, highly_composite_numbers

V01 = {"enabled": True, "max_train_batch_size": 10000, "micro_batch_sizes": [8, 12, 16, 17], "min_gpus": 32,
       "max_gpus": 1500, "version": 0.1}


def test_the_batch_suits_the_most_world_sizes_and_each_size_gets_its_micro_batch_and_accumulation():
    assert highly_composite_numbers(1000) == [1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840]
    # DeepSpeed's own example of a 10k batch over 32-1500 GPUs: 9792, valid on 23 GPU counts
    batch, valid = compute_elastic_config({"elasticity": V01}, "0.19.8")
    assert batch == 9792 and len(valid) == 23 and valid[:4] == [32, 34, 36, 48] and valid[-1] == 1224
    for world in valid:
        cfg = load_config({"elasticity": V01}, world)
        micro, accum = cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps
        assert cfg.train_batch_size == batch == micro * accum * world
        assert micro == max(m for m in V01["micro_batch_sizes"] if (batch // world) % m == 0)  # fewest steps
    assert compute_elastic_config({"elasticity": V01}, "0.19.8", world_size=64) == (9792, valid, 17)
    with pytest.raises(ConfigError) as info:
        load_config({"elasticity": V01}, 40)
    assert [p for p, _ in info.value.issues] == ["elasticity"]
    assert "40 ranks cannot keep the elastic train_batch_size 9792" in str(info.value) and str(valid) in str(info.value)


def test_version_0_2_counts_nodes_and_model_parallel_ranks_and_gives_another_size_its_own_batch():
    v02 = {"enabled": True, "max_train_batch_size": 100, "micro_batch_sizes": [2, 4], "version": 0.2,
           "num_gpus_per_node": 4, "model_parallel_size": 2}
    cfg = load_config({"elasticity": v02, "tensor_parallel": {"size": 2}}, 8)  # 2 nodes, 4 data-parallel ranks
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (96, 4, 6)
    assert compute_elastic_config({"elasticity": v02}, "0.19.8") == (96, [2, 4, 6, 8, 12, 16, 24, 48])
    odd = load_config({"elasticity": v02, "tensor_parallel": {"size": 2}}, 10)  # 5 data-parallel ranks: not valid
    assert (odd.train_batch_size, odd.train_micro_batch_size_per_gpu, odd.gradient_accumulation_steps) == (100, 4, 5)
    with pytest.raises(ConfigError, match=r"elasticity.*model_parallel_size is 2, but this run has 1 ranks"):
        load_config({"elasticity": v02}, 8)
    with pytest.raises(ConfigError, match=r"version 0.1 counts data-parallel ranks only.*use version 0.2"):
        load_config({"elasticity": {**V01, "min_gpus": 1}, "tensor_parallel": {"size": 2}}, 8)


def test_batch_keys_beside_the_section_and_bad_sections_are_errors_naming_the_key():
    small = {"enabled": True, "max_train_batch_size": 12, "micro_batch_sizes": [1, 2], "version": 0.1}
    with pytest.raises(ConfigError) as info:
        load_config({"elasticity": small, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 2)
    assert [p for p, _ in info.value.issues] == ["train_micro_batch_size_per_gpu", "gradient_accumulation_steps"]
    assert "ignore_non_elastic_batch_info" in str(info.value)
    cfg = load_config({"elasticity": {**small, "ignore_non_elastic_batch_info": True},
                       "train_micro_batch_size_per_gpu": 4}, 2)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (12, 2, 3)
    for bad, says in (({"micro_batch_sizes": [1, 24]}, "above max_train_batch_size"),
                      ({"max_train_batch_size": None}, "needs max_train_batch_size"),
                      ({"micro_batch_sizes": [0, 2]}, "positive"), ({"version": 0.3}, "0.1 or 0.2"),
                      ({"min_gpus": 8, "max_gpus": 4}, "below min_gpus")):
        section = {k: v for k, v in {**small, **bad}.items() if v is not None}
        with pytest.raises(ConfigError, match="elasticity") as info:
            load_config({"elasticity": section}, 2)
        assert says in str(info.value), str(info.value)


def test_the_engine_says_it_is_elastic_and_initialize_logs_the_choice(caplog):
    import torch

    import zero.deepspeed as deepspeed

    config = {"elasticity": {"enabled": True, "max_train_batch_size": 12, "micro_batch_sizes": [1, 2],
                             "version": 0.2}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    with caplog.at_level(logging.WARNING, logger="zero"):  # DeepSpeed's accessors: the facade's engine
        engine, *_ = deepspeed.initialize(model=torch.nn.Linear(4, 4), config=config)
    assert engine.elasticity_enabled() and engine.is_elastic_model_parallel_supported()
    assert engine.train_batch_size() == 12 and engine.gradient_accumulation_steps() == 6
    assert any("elasticity: train_batch_size 12 = micro-batch 2 x accumulation 6 x 1" in r.getMessage()
               for r in caplog.records)


def test_the_loader_resumes_at_the_same_sample_on_another_number_of_ranks():
    """After 12 samples taken by 2 ranks, 3 ranks (or 4) take the next 12 samples of the epoch's
    order as 2 ranks would have: the same samples per step, grouped otherwise."""
    import torch

    from zero.data import ResumableLoader

    data = torch.utils.data.TensorDataset(torch.arange(48))

    def loaders(ranks: int, batch: int):
        return [ResumableLoader(data, batch_size=batch, num_replicas=ranks, rank=r) for r in range(ranks)]

    two = loaders(2, 2)
    its = [iter(dl) for dl in two]
    first = [next(it)[0] for it in its for _ in range(3)]  # one step of 12: 3 micro-batches of 2 on each rank
    state = two[0].state_dict()
    assert state["samples"] == 12 and state["batches"] == 3
    after_two = {int(x) for it in its for _ in range(3) for x in next(it)[0]}
    for ranks, batch, micro in ((3, 2, 2), (4, 1, 3)):  # 12 = batch x micro-batches x ranks
        others = loaders(ranks, batch)
        for dl in others:
            dl.load_state_dict(state)
        assert others[0].state_dict()["samples"] == 12  # loaded, not iterated yet: still the loaded position
        its = [iter(dl) for dl in others]
        after = {int(x) for it in its for _ in range(micro) for x in next(it)[0]}
        assert after == after_two and not after & {int(x) for b in first for x in b}, (ranks, sorted(after))
        assert others[0].state_dict()["samples"] == 24
