"""initialize() rejects a bad config with a clear error before it touches the model."""
import pytest
import torch

import zero
from zero.config import ConfigError
from zero.testing.models import MLP


def storage_of(model):
    return [p.data_ptr() for p in model.parameters()]


@pytest.mark.parametrize(
    "config, message",
    [
        ({"train_batch_size": 4, "zero_optimization": {"stage": 2, "reduce_bucket_sise": 10}},
         r"zero_optimization\.reduce_bucket_sise.*did you mean 'reduce_bucket_size'"),
        ({"train_batch_size": 4, "gradient_acumulation_steps": 2}, r"gradient_acumulation_steps.*gradient_accumulation_steps"),
        ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, r"10.*4.*2"),
        ({"train_batch_size": 4, "fp16": {"enabled": True}, "bf16": {"enabled": True}}, r"fp16.*bf16"),
        ({"train_batch_size": 4, "zero_optimization": {"stage": 5}}, r"zero_optimization\.stage"),
        ({"train_batch_size": 4, "zero_optimization": {"reduce_bucket_size": -1}}, r"reduce_bucket_size"),
        ({"train_batch_size": 4, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}},
         r"ratio=0.5 \(partial offload\) is not yet supported"),
        ({"train_batch_size": 4, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}},
         r"offload_optimizer\.nvme_path: is missing"),
        # settings that cannot go together (see [Note: rules that combine settings] in zero/config/rules.py)
        ({"train_batch_size": 4, "optimizer": {"type": "ZeroOneAdam"}, "zero_optimization": {"stage": 1}},
         r"zero_optimization\.stage: optimizer type ZeroOneAdam needs ZeRO stage 0, not 1"),
        ({"train_batch_size": 4, "optimizer": {"type": "OneBitAdam"}, "zero_optimization": {"stage": 3}},
         r"zero_optimization\.stage: optimizer type OneBitAdam needs ZeRO stage 0, 1 or 2"),
        ({"train_batch_size": 4, "optimizer": {"type": "OneBitAdam", "params": {"compress_param_gather": True}}},
         r"optimizer\.params\.compress_param_gather: .*applies to ZeRO stages 1 and 2"),
    ],
)
def test_bad_config_is_a_config_error_and_the_model_is_untouched(config, message):
    model = MLP()
    before = storage_of(model)
    with pytest.raises(ConfigError, match=message):
        zero.initialize(model=model, config={"optimizer": {"type": "AdamW"}, **config})
    assert storage_of(model) == before


@pytest.mark.parametrize("make, config, message", [
    (lambda ps: torch.optim.Adagrad(ps, lr=0.1), {"optimizer": {"type": "OneBitAdam"}},
     r"optimizer\.type: the config's optimizer is OneBitAdam but initialize\(\) was given a Adagrad too"),
])
def test_an_optimizer_object_that_does_not_fit_the_config_is_a_config_error(make, config, message):
    """Raised by load_config (initialize passes the object's class), before the model is touched."""
    model = MLP()
    before = storage_of(model)
    with pytest.raises(ConfigError, match=message):
        zero.initialize(model=model, optimizer=make(model.parameters()), config={"train_batch_size": 4, **config})
    assert storage_of(model) == before


def test_an_optimizer_built_by_a_callable_is_checked_against_the_config_too():
    """initialize(optimizer=callable) builds the object after load_config (once a model is sliced):
    zero.config.rules.check_optimizer_object applies the same rule to it, before the engine exists."""
    with pytest.raises(ConfigError, match=r"optimizer\.type: the config's optimizer is OneBitAdam but initialize\(\) "
                                          r"was given a SGD too"):
        zero.initialize(model=MLP(), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), config={
            "train_batch_size": 4, "optimizer": {"type": "OneBitAdam"}})


def test_pipeline_stages_without_a_pipeline_module_is_a_config_error():
    with pytest.raises(ConfigError, match=r"pipeline\.stages: is 2: the model must be a zero\.pipe\.PipelineModule"):
        zero.initialize(model=MLP(), config={"train_batch_size": 4, "optimizer": {"type": "AdamW"},
                                             "pipeline": {"stages": 2}})


def test_training_without_an_optimizer_is_a_clear_error():
    engine, *_ = zero.initialize(model=MLP(), config={"train_batch_size": 4})  # an evaluation engine, as DeepSpeed's
    with pytest.raises(RuntimeError, match="built without an optimizer.*Add an 'optimizer' section"):
        engine.step()


def test_a_whole_tensor_client_optimizer_is_refused_with_the_reason():
    model = MLP()
    with pytest.raises(ValueError, match="LBFGS, which zero cannot run on partitioned shards: its line search"):
        zero.initialize(model=model, optimizer=torch.optim.LBFGS(model.parameters(), lr=0.1), config={"train_batch_size": 4})


def test_json_path_config_and_a_world_of_one_without_torchrun(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 8, "gradient_accumulation_steps": 2, "optimizer": {"type": "Adam"},'
                    ' "zero_optimization": {"stage": 2}}')
    engine, optimizer, loader, scheduler = zero.initialize(model=MLP(), config=str(path))
    assert engine.config.train_micro_batch_size_per_gpu == 4 and engine.config.gradient_accumulation_steps == 2
    assert engine.config.zero_optimization.stage == 2 and engine.world_size == 1
    assert optimizer is engine.optimizer and loader is None and scheduler is None
    for _ in range(2):
        assert engine.is_gradient_accumulation_boundary() == (engine.micro_steps % 2 == 1)
        engine.backward(engine(torch.randn(4, 13, device=engine.device), torch.randn(4, 5, device=engine.device)))
        engine.step()
    assert engine.global_steps == 1


def test_client_adamw_with_param_groups_and_a_scheduler():
    model = MLP()
    groups = [{"params": model.layers[0].parameters(), "weight_decay": 0.0},
              {"params": [p for layer in model.layers[1:] for p in layer.parameters()], "lr": 5e-3}]
    opt = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1)
    config = {"train_batch_size": 2, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}
    engine, optimizer, _, scheduler = zero.initialize(model=model, optimizer=opt, config=config)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.0, 0.1]
    assert [g["lr"] for g in optimizer.param_groups][1] != 1e-2  # WarmupLR took over the lr
    engine.backward(engine(torch.randn(2, 13, device=engine.device), torch.randn(2, 5, device=engine.device)))
    engine.step()
    assert scheduler.get_last_lr() == engine.get_lr()


def test_training_data_gives_a_loader_of_micro_batches():
    data = torch.utils.data.TensorDataset(torch.randn(20, 13), torch.randn(20, 5))
    _, _, loader, _ = zero.initialize(model=MLP(), training_data=data,
                                      config={"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW"}})
    x, y = next(iter(loader))
    assert x.shape == (4, 13)


def test_logging_keys_print_progress_timings_and_memory(capsys):
    config = {"train_batch_size": 2, "optimizer": {"type": "AdamW"}, "steps_per_print": 2,
              "wall_clock_breakdown": True, "memory_breakdown": True, "dump_state": True}
    engine, *_ = zero.initialize(model=MLP(), config=config)
    for _ in range(2):
        engine.backward(engine(torch.randn(2, 13, device=engine.device), torch.randn(2, 5, device=engine.device)))
        engine.step()
    out = capsys.readouterr().out
    assert "engine state" in out and "zero: step 2" in out
    assert "ms per step: forward" in out and "model-state bytes per rank" in out
