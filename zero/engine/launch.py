"""Starting training: wrap a model in an engine (`initialize`, DeepSpeed's one call).

    engine, optimizer, loader, scheduler = zero.initialize(model=model, config="ds_config.json")

`initialize` reads the config (every config error is raised here, first), builds the (pp, dp,
tp) mesh the config asks for, slices an unsliced HuggingFace model by its tensor-parallel plan
(DeepSpeed's AutoTP), and builds one `Engine` on the mesh (see [Note: one engine, any mesh] in
zero/engine/loop.py). (It lives here, not in a module named `initialize`: a submodule of that name
would shadow the function `zero.initialize` once imported.)
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from zero.config import ConfigError, load_config
from zero.config.rules import check_optimizer_object
from zero.engine import Engine
from zero.parallel.comm import Comm
from zero.parallel.dims import ParallelDims
from zero.parallel.groups import ParallelGroups
from zero.parallel.process_group import compute_device, init_distributed

log = logging.getLogger("zero")


def initialize(
    args=None,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | Callable | None = None,
    model_parameters: Iterable | None = None,
    training_data=None,
    lr_scheduler=None,
    collate_fn: Callable | None = None,
    config: dict | str | os.PathLike | None = None,
    config_params: dict | None = None,
    dist_init_required: bool | None = None,
    mpu=None,
):
    """Wrap `model` for ZeRO training; DeepSpeed's `deepspeed.initialize` signature and result.

    Args:
        args: unused (DeepSpeed reads `args.deepspeed_config`; pass `config` instead).
        model: the torch module to train (a zero.pipe.PipelineModule for pipeline stages).
        optimizer: a torch optimizer whose hyperparameters and param groups are used (Adam/AdamW
            run as zero's Adam, other element-wise optimizers on the shards), or a callable
            building one from the parameters, or None to build the config's `optimizer`.
        model_parameters: parameters or param groups to train (default: model.parameters()).
        training_data: a torch Dataset; a distributed DataLoader over it is returned.
        lr_scheduler: a scheduler object, or a callable taking the optimizer and returning one;
            None builds the config's `scheduler` if any.
        collate_fn: collate function of the returned DataLoader.
        config: a DeepSpeed-style config dict or path to a JSON file.
        config_params: DeepSpeed's older name for `config`.
        dist_init_required: join torchrun's process group if not yet joined (default: yes).
        mpu: what UlyssesSPAttentionHF.register_with_transformers returned (its sequence-parallel
            size becomes `sequence_parallel_size`); a Megatron model-parallel mpu is refused (use
            `tensor_parallel.size`).

    Returns:
        (engine, optimizer, training_dataloader or None, lr_scheduler or None): the engine is a
        zero.Engine (`zero.deepspeed.initialize` returns the DeepSpeedEngine facade over it).
    """
    return launch(Engine, args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                  training_data=training_data, lr_scheduler=lr_scheduler, collate_fn=collate_fn, config=config,
                  config_params=config_params, dist_init_required=dist_init_required, mpu=mpu)


def launch(
    engine_class: type[Engine],
    args=None,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | Callable | None = None,
    model_parameters: Iterable | None = None,
    training_data=None,
    lr_scheduler=None,
    collate_fn: Callable | None = None,
    config: dict | str | os.PathLike | None = None,
    config_params: dict | None = None,
    dist_init_required: bool | None = None,
    mpu=None,
):
    """`initialize` building an engine of `engine_class` (zero.Engine, or a facade over it)."""
    if model is None:
        raise ValueError("initialize() needs model=")
    from zero.compilation import backend_name, unwrap_compiled

    model, compiled_with = unwrap_compiled(model)  # a whole-model graph would hold zero's hooks: its blocks instead
    config = config if config is not None else config_params
    if config is None:
        raise ValueError("initialize() needs config= (a dict or a JSON path)")
    if dist_init_required is not False:
        init_distributed()
    elif not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise RuntimeError(
            f"zero.initialize(dist_init_required=False): WORLD_SIZE={os.environ['WORLD_SIZE']} says this process is "
            f"one of several ranks, but no torch.distributed process group exists, so every rank would train alone. "
            f"Call torch.distributed.init_process_group() first, or leave dist_init_required unset.")
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if mpu is not None:
        config = _with_mpu(config, mpu)
    from zero.pipe.module import PipelineModule

    pipelined = isinstance(model, PipelineModule)
    client = type(optimizer) if isinstance(optimizer, torch.optim.Optimizer) else None
    # every config error is raised here, first, before anything is built or sliced
    cfg = load_config(config, world_size=world_size, pipeline_stages=model.num_stages if pipelined else None,
                      client_optimizer=client, model_is_pipeline=pipelined)
    per_node = os.environ.get("LOCAL_WORLD_SIZE")
    if cfg.elasticity.enabled and cfg.elasticity.version >= 0.2 and per_node and \
            int(per_node) != cfg.elasticity.num_gpus_per_node:  # version 0.2 counts nodes of this many ranks
        why = (f"is {cfg.elasticity.num_gpus_per_node}, but torchrun started {per_node} ranks per node "
               f"(LOCAL_WORLD_SIZE): version 0.2 counts nodes, so give the ranks per node (or use version 0.1, "
               f"which counts ranks)")
        raise ConfigError(f"invalid config: elasticity.num_gpus_per_node: {why}", [("elasticity.num_gpus_per_node", why)])
    if cfg.elasticity.enabled and Comm().rank == 0:  # what this start trains with (zero/config/elasticity.py)
        from zero.config.elasticity import plan

        parallel = cfg.pipeline.stages * cfg.tensor_parallel.size * cfg.sequence_parallel_size
        chosen = plan(cfg, world_size, parallel)
        log.warning("zero: elasticity: %s", chosen.describe())  # shown by default, as auto_resume's line is
    section = cfg.compile if isinstance(cfg.compile, dict) else {}
    if (compiled_with is not None or section.get("enabled")) and cfg.zero_optimization.stage == 3:
        from zero.compilation import find_blocks
        from zero.init import set_z3_leaf_modules

        blocks = find_blocks(model)  # each block one unit, so no unit (no hook) lies inside a compiled block
        if blocks:
            set_z3_leaf_modules(model, [type(blocks[0])])
    auto_plan = None
    if cfg.tensor_parallel.size > 1:
        from zero.tp.plans import auto_plan_for

        auto_plan = auto_plan_for(model, cfg.tensor_parallel.size)
    dims = ParallelDims.from_config(cfg, world_size)  # see [Note: parallel dimensions]
    mesh = None
    if pipelined or dims.tp > 1:
        from zero.parallel.mesh import build_mesh

        mesh = build_mesh(dims.pp, dims.size("batch"), dims.tp, compute_device(Comm()))
        if auto_plan is not None:  # an HF model nobody sliced: its plan (DeepSpeed's AutoTP)
            from zero.tp import parallelize_for_initialize

            model_parameters = parallelize_for_initialize(model, mesh, auto_plan, model_parameters, optimizer)
    if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer(model.parameters() if model_parameters is None else model_parameters)
        if isinstance(optimizer, torch.optim.Optimizer):  # the rules load_config checks for an optimizer passed
            check_optimizer_object(cfg, type(optimizer))
    groups = ParallelGroups(dims, mesh)
    if dims.spatial > 1:  # each rank computes its slab of every volume (zero/spatial, docs/spatial.md)
        from zero.spatial import parallelize as split_volumes

        split_volumes(model, groups.comm("spatial"), dim=cfg.spatial_parallel_dims)
    engine = engine_class(model, cfg, mesh, parallel=groups, model_parameters=model_parameters,
                          optimizer=optimizer, lr_scheduler=lr_scheduler)
    if compiled_with is not None:
        if engine.dp.rank == 0:
            log.warning("zero: the model was compiled whole with torch.compile (backend %r); zero compiles its blocks "
                        "instead, with its hooks outside the graphs (engine.compile(); see docs/compile.md)",
                        backend_name(compiled_with))
        engine.compile(backend=section.get("backend", compiled_with), compile_kwargs=section.get("kwargs"))
    elif section.get("enabled"):
        engine.compile(backend=section.get("backend", "inductor"), compile_kwargs=section.get("kwargs"))
    loader = None
    if training_data is not None:  # its position in the epoch goes into checkpoints
        from zero.data import ResumableLoader

        loader = engine.training_dataloader = ResumableLoader(
            training_data, batch_size=cfg.train_micro_batch_size_per_gpu, num_replicas=engine.parallel.size("batch"),
            rank=engine.parallel.index("batch"),  # a sequence-parallel group shares its samples
            collate_fn=collate_fn, drop_last=cfg.dataloader_drop_last)
    if cfg.checkpoint.auto_resume:  # after the loader: its position is part of the state
        from zero.checkpoint.periodic import auto_resume

        auto_resume(engine, cfg.checkpoint.dir)
    return engine, engine.optimizer, loader, engine.lr_scheduler


def _with_mpu(config, mpu):
    """The config with `sequence_parallel_size` from a sequence-parallel mpu (checked against the
    config's own key)."""
    import json
    import pathlib

    size_of = getattr(mpu, "get_sequence_parallel_world_size", None)
    if size_of is None:
        raise ValueError("initialize(mpu=...): zero takes the mpu UlyssesSPAttentionHF.register_with_transformers "
                         "returns; for Megatron-style tensor parallelism set tensor_parallel.size in the config")
    data = json.loads(pathlib.Path(config).read_text()) if isinstance(config, (str, os.PathLike)) else dict(config)
    size, given = size_of(), data.get("sequence_parallel_size")
    if given not in (None, 1, size):
        raise ValueError(f"initialize(mpu=...) has a sequence-parallel size of {size}, the config's "
                         f"sequence_parallel_size is {given}: give the same number, or leave the key out")
    return {**data, "sequence_parallel_size": size}
