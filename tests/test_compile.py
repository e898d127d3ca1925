"""torch.compile with every stage (zero/compilation.py, [Note: compiled blocks]): each repeated
block compiled, zero's hooks outside the graphs, the same numbers as eager, no graph break inside
a block and no recompilation once training runs."""
import logging

import pytest
import torch

STEPS = 3


def _gpt():
    from zero.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16))


def _config(stage: int, offload: bool = False, accumulation: int = 1, bf16: bool = False, compile_=None) -> dict:
    zo = {"stage": stage}
    if offload:
        zo.update(offload_optimizer={"device": "cpu"}, **({"offload_param": {"device": "cpu"}} if stage == 3 else {}))
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": accumulation,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": zo,
            **({"bf16": {"enabled": True}} if bf16 else {}), **({"compile": compile_} if compile_ else {})}


def _train(config: dict, how: str | None, backend: str = "aot_eager"):
    """STEPS optimizer steps of a GPT: eager (None), engine.compile() ("engine"), the config's
    compile section ("config"), or torch.compile(model) before initialize ("whole"). Returns the
    final parameters, the compile counters after steps 2 and 3, and what the engine compiled."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    import zero

    torch._dynamo.reset()
    counters.clear()
    model = _gpt()
    if how == "whole":
        model = torch.compile(model, backend=backend)
    if how == "config":
        config = {**config, "compile": {"enabled": True, "backend": backend}}
    engine, *_ = zero.initialize(model=model, config=config)
    if how == "engine":
        engine.compile(backend=backend)
    g = torch.Generator().manual_seed(1 + engine.comm.rank)
    seen = []
    for _ in range(STEPS):
        for _micro in range(engine.config.gradient_accumulation_steps):
            x = torch.randint(0, 64, (2, 9), generator=g)
            engine.backward(engine(x[:, :-1], x[:, 1:]))
            engine.step()
        seen.append((counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())))
    state = engine.consolidated_16bit_state_dict() or {}
    blocks = [type(b).__name__ for b in getattr(engine, "_compiled_blocks", [])]
    return [t.float().clone() for _, t in sorted(state.items())], seen, blocks, engine.is_compiled


@pytest.mark.parametrize("stage,offload,accumulation,bf16", [(0, False, 1, False), (1, False, 2, False),
                                                             (2, False, 1, True), (2, True, 2, False),
                                                             (3, False, 2, False), (3, True, 1, False)])
def test_compiled_blocks_train_as_eager_at_every_stage(dist_run, stage, offload, accumulation, bf16):
    config = _config(stage, offload, accumulation, bf16)
    for (eager, _, none, eager_flag), (compiled, seen, blocks, flag) in zip(
            dist_run(2, _train, config, None), dist_run(2, _train, config, "engine")):
        assert not none and not eager_flag and flag and blocks == ["Block", "Block"], blocks
        assert seen[-1] == seen[-2] == (1, 0), seen  # one graph for both blocks, made once; no graph break
        assert len(compiled) == len(eager)  # rank 0 holds the whole model, the others nothing
        assert all(torch.equal(a, b) for a, b in zip(compiled, eager)), f"stage {stage}"  # aot_eager: bit for bit


def test_a_model_compiled_whole_or_by_the_config_trains_as_eager(dist_run, caplog):
    """torch.compile(model) before initialize: the blocks are compiled instead, with a warning
    (a whole-model graph would hold zero's hooks); the config's compile section does the same."""
    config = _config(3)
    eager = dist_run(2, _train, config, None)
    for how in ("whole", "config"):
        for (ref, *_), (params, seen, blocks, flag) in zip(eager, dist_run(2, _train, config, how)):
            assert flag and blocks == ["Block", "Block"] and seen[-1] == seen[-2] and seen[-1][1] == 0, (how, seen)
            assert len(params) == len(ref) and all(torch.equal(a, b) for a, b in zip(params, ref)), how
    import zero

    with caplog.at_level(logging.WARNING, logger="zero"):
        engine, *_ = zero.initialize(model=torch.compile(_gpt(), backend="aot_eager"), config=_config(0))
    assert not isinstance(engine.module, torch._dynamo.eval_frame.OptimizedModule) and engine.is_compiled
    assert any("compiled whole with torch.compile (backend 'aot_eager')" in r.getMessage() for r in caplog.records)


def test_inductor_gives_the_same_numbers_at_every_stage(dist_run):
    """Inductor's kernels round otherwise than eager's (6.5e-6 apart after 3 AdamW steps at lr
    1e-2, at every stage alike); under zero, stage 3 with offload equals stage 0, compiled both."""
    stage0 = dist_run(2, _train, _config(0), "engine", "inductor")
    stage3 = dist_run(2, _train, _config(3, offload=True), "engine", "inductor")
    for (a, *_), (b, seen, blocks, _) in zip(stage0, stage3):
        assert blocks == ["Block", "Block"] and seen[-1] == seen[-2] and seen[-1][1] == 0, seen
        worst = max([((x - y).abs().max() / y.abs().max()).item() for x, y in zip(b, a)], default=0.0)
        assert len(a) == len(b) and worst <= 1e-6, worst


def test_what_cannot_be_compiled_is_refused_clearly():
    import zero
    from zero.config import ConfigError, load_config

    engine, *_ = zero.initialize(model=_gpt(), config=_config(1))
    with pytest.raises(NotImplementedError, match="DeepCompile's pass schedules"):
        engine.compile(schedule=[(0, ["zero1"])])
    with pytest.raises(NotImplementedError, match="compiled autograd"):
        engine.compile(compiled_autograd_enabled=True)
    with pytest.raises(ValueError, match=r"modules \['Linear'\] are not part of the engine's model"):
        engine.compile(modules=[torch.nn.Linear(2, 2)])
    assert not engine.is_compiled
    staged, *_ = zero.initialize(model=_gpt(), config=_config(3))
    with pytest.raises(ValueError, match="records CUDA graphs.*stage 3 frees and gathers"):
        staged.compile(compile_kwargs={"mode": "reduce-overhead"})
    with pytest.raises(ConfigError, match=r"compile.deepcompile.*set compile.enabled \(or call engine.compile\(\)\)"):
        load_config({**_config(1), "compile": {"deepcompile": True}}, 1)
    with pytest.raises(ConfigError, match=r"compile.backend.*expected a torch.compile backend name"):
        load_config({**_config(1), "compile": {"enabled": True, "backend": 3}}, 1)


class _MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class _Checkpointed(torch.nn.Module):
    """Blocks called through activation checkpointing: torch's, or DeepSpeed's (zero.activations)."""

    def __init__(self, how: str):
        super().__init__()
        self.how, self.blocks = how, torch.nn.ModuleList(_MLP() for _ in range(3))

    def forward(self, x, y):
        from zero.deepspeed import checkpointing

        for block in self.blocks:
            x = (torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if self.how == "torch"
                 else checkpointing.checkpoint(block, x))
        return torch.nn.functional.mse_loss(x, y)


def _train_checkpointed(how: str, compiled: bool):
    import torch._dynamo
    from torch._dynamo.utils import counters

    import zero

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    engine, *_ = zero.initialize(model=_Checkpointed(how), config=_config(3))
    if compiled:
        engine.compile(backend="aot_eager")
    g = torch.Generator().manual_seed(engine.comm.rank)
    for _ in range(STEPS):
        engine.backward(engine(torch.randn(2, 16, generator=g), torch.randn(2, 16, generator=g)))
        engine.step()
    state = engine.consolidated_16bit_state_dict() or {}
    return [t.clone() for _, t in sorted(state.items())], sum(counters["graph_break"].values()), engine.is_compiled


@pytest.mark.parametrize("how", ["torch", "deepspeed"])
def test_compiled_blocks_under_activation_checkpointing_train_as_eager(dist_run, how):
    for (eager, *_), (compiled, breaks, flag) in zip(dist_run(2, _train_checkpointed, how, False),
                                                     dist_run(2, _train_checkpointed, how, True)):
        assert flag and breaks == 0 and len(eager) == len(compiled)
        assert all(torch.equal(a, b) for a, b in zip(eager, compiled)), how


def _tensor_parallel_compile():
    import zero
    from zero.testing.models import GPT, GPTConfig

    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"}, "tensor_parallel": {"size": 2}}
    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16, fused_qkv=False))
    zero.tp.parallelize(model, zero.tp.mesh(config), "gpt")
    engine, *_ = zero.initialize(model=model, config=config)
    try:
        engine.compile(backend="aot_eager")
    except NotImplementedError as exc:
        return str(exc), engine.is_compiled
    return None, engine.is_compiled


def test_the_tensor_parallel_engine_refuses_to_compile_clearly(dist_run):
    for message, compiled in dist_run(2, _tensor_parallel_compile):
        assert message and "tensor slicing is not implemented yet" in message and not compiled, message


def _engine_compiled_whole(stage: int, wrap: bool):
    import torch._dynamo

    import zero

    torch._dynamo.reset()
    engine, *_ = zero.initialize(model=_gpt(), config=_config(stage))
    run = torch.compile(engine, backend="aot_eager") if wrap else engine
    g = torch.Generator().manual_seed(1 + engine.comm.rank)
    for _ in range(STEPS):
        x = torch.randint(0, 64, (2, 9), generator=g)
        engine.backward(run(x[:, :-1], x[:, 1:]))
        engine.step()
    return [t.clone() for _, t in sorted((engine.consolidated_16bit_state_dict() or {}).items())]


def test_torch_compile_of_the_engine_after_initialize_gives_the_eager_numbers(dist_run):
    """torch.compile(engine): dynamo breaks its graphs at zero's hooks (use engine.compile() for
    whole blocks), and the numbers stay those of eager mode."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for eager, compiled in zip(dist_run(2, _engine_compiled_whole, 3, False),
                                   dist_run(2, _engine_compiled_whole, 3, True)):
            assert len(eager) == len(compiled) and all(torch.equal(a, b) for a, b in zip(eager, compiled))


def _graph_targets(stage: int):
    """What the graphs dynamo hands the backend call, for a stage-`stage` engine's compiled blocks."""
    import torch._dynamo

    import zero

    torch._dynamo.reset()
    seen = []

    def recording(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module"))
        return gm.forward

    engine, *_ = zero.initialize(model=_gpt(), config=_config(stage, offload=stage == 3))
    engine.compile(backend=recording)
    x = torch.randint(0, 64, (2, 9))
    for _ in range(2):
        engine.backward(engine(x[:, :-1], x[:, 1:]))
        engine.step()
    return seen


def test_the_graphs_hold_no_collective_and_no_hook_of_zeros(dist_run):
    for targets in dist_run(2, _graph_targets, 3):
        assert any("linear" in t for t in targets), targets  # the block's own work is there
        offending = [t for t in targets if any(w in t.lower() for w in ("c10d", "all_gather", "reduce_scatter",
                                                                         "all_reduce", "broadcast", "zero."))]
        assert not offending, offending


def _wide(how: str):
    """A GPT whose blocks hold layers of 1M elements, which stage 3 makes units of their own."""
    import torch._dynamo

    import zero
    from zero.models import GPT, GPTConfig

    torch._dynamo.reset()
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("zero").addHandler(handler)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=4, n_embd=512))
    config = _config(3, compile_={"enabled": True, "backend": "aot_eager"} if how == "config" else None)
    try:
        engine, *_ = zero.initialize(model=model, config=config)
        if how == "engine":
            engine.compile(backend="aot_eager")
    finally:
        logging.getLogger("zero").removeHandler(handler)
    x = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(engine.comm.rank))
    engine.backward(engine(x[:, :-1], x[:, 1:]))
    engine.step()
    params = [t.clone() for _, t in sorted((engine.consolidated_16bit_state_dict() or {}).items())]
    return engine.is_compiled, [r.getMessage() for r in records if "compile leaves" in r.getMessage()], params


def test_stage_3_blocks_with_units_inside_are_made_one_unit_by_the_config_or_left_eager_with_a_warning(dist_run):
    eager = dist_run(2, _wide, "none")
    late = dist_run(2, _wide, "engine")  # units are fixed by then: the blocks stay eager, one warning says why
    early = dist_run(2, _wide, "config")  # the config's compile section makes each block one unit first
    for (_, _, ref), (late_flag, said, _), (flag, quiet, params) in zip(eager, late, early):
        assert not late_flag and len(said) == 1 and "set_z3_leaf_modules(model, [Block])" in said[0], said
        assert flag and not quiet and len(params) == len(ref) and all(torch.equal(a, b) for a, b in zip(params, ref))


def _llama(compiled: bool):
    import torch._dynamo
    from torch._dynamo.utils import counters
    from transformers import LlamaConfig, LlamaForCausalLM

    import zero

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=10,
                                         num_attention_heads=4, num_key_value_heads=2))
    config = _config(3, compile_={"enabled": True, "backend": "aot_eager"} if compiled else None)
    engine, *_ = zero.initialize(model=model, config=config)
    g = torch.Generator().manual_seed(engine.comm.rank)
    for _ in range(STEPS):
        x = torch.randint(0, 64, (2, 8), generator=g)
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
    params = [t.clone() for _, t in sorted((engine.consolidated_16bit_state_dict() or {}).items())]
    blocks = {type(b).__name__: 0 for b in getattr(engine, "_compiled_blocks", [])}
    return params, counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()), \
        len(getattr(engine, "_compiled_blocks", [])), list(blocks)


def test_an_hf_llama_compiles_its_ten_layers_into_one_graph_at_stage_3(dist_run):
    """Ten decoder layers, one graph (a training forward's key/value cache would make each layer a
    graph of its own, past dynamo's limit of 8), no graph break, the numbers of eager mode."""
    pytest.importorskip("transformers")
    for (ref, *_), (params, graphs, breaks, count, kinds) in zip(dist_run(2, _llama, False), dist_run(2, _llama, True)):
        assert kinds == ["LlamaDecoderLayer"] and count == 10 and graphs == 1 and breaks == 0, (kinds, graphs, breaks)
        assert len(params) == len(ref) and all(torch.equal(a, b) for a, b in zip(params, ref))


def test_a_compiled_block_copies_with_its_own_weights_and_pickles_back_eager():
    """An EMA copy or a reference model (copy.deepcopy) runs its own weights through the shared
    compiled forward; torch.save(model) of a compiled model loads back as an eager one."""
    import copy
    import io

    from zero.compilation import CompiledForward, compile_blocks

    model, x = _gpt(), torch.randint(0, 64, (2, 8))
    ref = model(x, x)
    assert len(compile_blocks(model, "aot_eager")) == 2 and torch.equal(model(x, x), ref)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    assert isinstance(twin.blocks[0].forward, CompiledForward) and twin.blocks[0].forward.block is twin.blocks[0]
    assert torch.allclose(twin(x, x), torch.tensor(64.0).log()) and torch.equal(model(x, x), ref)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    back = torch.load(buffer, weights_only=False)
    assert not isinstance(back.blocks[0].forward, CompiledForward) and torch.equal(back(x, x), ref)


def _hf_trainer(compiled: bool, out: str):
    import torch._dynamo
    from test_hf_trainer import Tokens, _config, _gathered, arguments, tiny
    from torch._dynamo.utils import counters

    from zero.integrations.hf import ZeroTrainer

    torch._dynamo.reset()
    counters.clear()
    model = tiny("llama")
    extra = {"torch_compile": True, "torch_compile_backend": "aot_eager"} if compiled else {}
    trainer = ZeroTrainer(model=model, args=arguments(out, 2, 3, **extra), train_dataset=Tokens(),
                          eval_dataset=Tokens(16), zero_config=_config(3, False))
    trainer.train()
    params = _gathered(model)
    loss = trainer.evaluate()["eval_loss"]
    return params, loss, trainer.engine.is_compiled, counters["stats"]["unique_graphs"], \
        sum(counters["graph_break"].values())


def test_hf_trainers_torch_compile_compiles_the_blocks_under_zero(dist_run, tmp_path):
    """TrainingArguments(torch_compile=True) with ZeroTrainer: zero compiles the decoder layers
    (stage 3, one unit each), accelerate does not wrap the whole model for evaluation, and training
    and evaluation give the eager numbers."""
    pytest.importorskip("transformers")
    for (ref, ref_loss, *_), (params, loss, flag, graphs, breaks) in zip(
            dist_run(2, _hf_trainer, False, str(tmp_path / "eager")), dist_run(2, _hf_trainer, True, str(tmp_path / "c"))):
        assert flag and breaks == 0 and 1 <= graphs <= 2, (flag, graphs, breaks)  # training's graph, and eval's
        # each block one unit sums the clipping norm in another order: equal up to round-off
        worst = max(((params[n] - ref[n]).abs().max() / ref[n].abs().max()).item() for n in ref)
        assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss) and worst <= 1e-6, (loss, ref_loss, worst)
