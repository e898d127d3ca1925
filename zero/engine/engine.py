"""zero's engine: the training loop (zero/engine/loop.py) and what a user asks of it.

    engine, optimizer, loader, scheduler = zero.initialize(model=model, config=cfg)
    for x, y in loader:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()

`Engine` adds to the loop its public methods: the last step's numbers, the measured reports,
saving and loading, moving model states off the device and back, and compiling blocks. Each
delegates to the room that does the work (zero/checkpoint/, zero/offload/relocation.py,
zero/compilation.py). DeepSpeed's own accessors and methods (`engine.fp16_enabled()`,
`engine.get_batch_info()`, ...) are not here: they are the facade zero.deepspeed puts over it
(`zero.deepspeed.DeepSpeedEngine`, what `import zero.deepspeed as deepspeed; deepspeed.initialize`
returns).
"""
from __future__ import annotations

import gc
import logging
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from zero.engine.loop import TrainingLoop
from zero.parallel.mesh import refuse_whole_model_save

log = logging.getLogger("zero")


class Engine(TrainingLoop):
    """A model wrapped for ZeRO data-parallel training, on any parallel dimensions; see [Note: one
    engine, any mesh] in zero/engine/loop.py. Build it with `zero.initialize`.

    Args:
        module: the model (a zero.pipe.PipelineModule to train with pipeline stages).
        config: the validated config (`zero.load_config`).
        mesh: the mesh of a run with pipeline stages or tensor slices (zero/parallel/mesh.py); None for
            data parallelism over the whole world.
        parallel: the run's process groups by name (zero/parallel/groups.py); None: the ones the
            config's dimensions give on `mesh`.
        model_parameters: parameters or param groups to train (default: the module's).
        optimizer: a torch optimizer whose hyperparameters and param groups are used.
        lr_scheduler: a scheduler, or a callable building one from the optimizer.
    """

    # -- the last step --------------------------------------------------------------------------

    def get_global_grad_norm(self) -> float | None:
        """Norm of the averaged, unscaled gradient of the last step (before clipping)."""
        return self.optimizer.global_grad_norm

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    @property
    def world_size(self) -> int:
        """The data-parallel ranks (with hybrid sharding: every replica's; the states are sharded over
        `engine.comm`)."""
        return self.dp.world_size

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

    @property
    def global_rank(self) -> int:
        return self.dp.rank

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without fp16)."""
        return self.optimizer.loss_scaler.scale

    def was_step_applied(self) -> bool:
        """Whether the last `step()` updated the weights (False inside an accumulation window and on
        a skipped (overflowed) step)."""
        return self.progress.last_step_applied

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Make the coming `step()` an accumulation boundary (True) or not (False), whatever the
        micro-step count says (DeepSpeed's manual override)."""
        ga = self.config.gradient_accumulation_steps
        at = self.progress.micro_steps % ga == ga - 1
        if is_boundary and not at:
            self.progress.micro_steps += ga - 1 - self.progress.micro_steps % ga
        elif not is_boundary and at:
            raise ValueError("set_gradient_accumulation_boundary(False) at the last micro-step of a window: "
                             "raise gradient_accumulation_steps instead")
        self.optimizer.at_boundary = self.is_gradient_accumulation_boundary()

    def get_mom(self) -> list:
        """Per param group, Adam's betas, or the momentum of an optimizer that has one (SGD,
        RMSprop), or None (DeepSpeed's momentum accessor)."""
        client = self.optimizer.client.defaults if self.optimizer.client is not None else None
        if client is None:
            return [tuple(g["betas"]) for g in self.optimizer.param_groups]
        key = "momentum" if "momentum" in client else "betas" if "betas" in client else None
        return [(tuple(g[key]) if key == "betas" else g[key]) if key else None for g in self.optimizer.param_groups]

    # -- reports ----------------------------------------------------------------------------

    def memory_report(self) -> dict[str, Any]:
        """Bytes this rank holds, measured from the storages the engine holds (an alias counts
        once; a freed stage-3 buffer counts 0), not computed from a formula.

        Keys: `params`, `grads`, `fp32_master`, `optimizer_states` and their sum
        `model_states_total`; `device_bytes` and `host_bytes` (where they live: offload moves
        optimizer states, and stage-3 parameter shards, to the host); `host_staging` (offload's
        host gradient and copy-back buffers); `reduce_buffers` and `reduce_buffers_peak`
        (gradient buffers being filled or reduced, now and at most). Stage 3 adds
        `gathered_bytes` and `gathered_peak` (gathered full parameters now and at most, persistent
        ones excluded), `gather_buffers_peak` (all-gather outputs before they are copied into
        units) and `persistent_params` (elements kept whole on every rank). With a mesh, `mesh`:
        its shape, this rank's coordinates and how it divides the parameters (see MeshTraffic).
        `offloaded_bytes`: the host copies of states `offload_states()` moved off the device.
        """
        report = self.optimizer.memory_report()
        away = self.__dict__.get("_away")
        report["offloaded_bytes"] = away.host_bytes() if away is not None else 0  # offload_states' host copies
        if self.traffic is not None:
            report["mesh"] = self.traffic.memory()
        return report

    # -- saving -----------------------------------------------------------------------------

    def consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict | None:
        """The full state dict in the training dtype on rank 0 (None elsewhere); all ranks call it.
        Under stage 3 parameters are gathered one at a time."""
        from zero.checkpoint import consolidated_state_dict

        refuse_whole_model_save(self.mesh, "consolidated_16bit_state_dict")
        self._check_states_home("consolidated_16bit_state_dict()")
        state = consolidated_state_dict(self.module, self.comm, exclude_frozen_parameters)
        return state if self.dp.rank == 0 else None  # hybrid sharding: one copy, not one per replica

    _zero3_consolidated_16bit_state_dict = consolidated_16bit_state_dict  # DeepSpeed's name (accelerate calls it)

    def save_16bit_model(self, save_dir: str | os.PathLike, save_filename: str = "model.safetensors",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Save the consolidated 16-bit state dict from rank 0 (atomically); all ranks call it.
        `model.safetensors` by default (tied parameters once, as HuggingFace saves them); a
        filename ending in `.bin` or `.pt` gets torch.save instead.

        Under stage 3 this needs `stage3_gather_16bit_weights_on_model_save: true` (as in
        DeepSpeed); otherwise it warns, saves nothing and returns False.
        """
        from zero.checkpoint import atomic_save, checked_save_path

        refuse_whole_model_save(self.mesh, "save_16bit_model")
        save_path = checked_save_path(save_dir, save_filename)  # on every rank, before any gather or write
        if self.config.zero_optimization.stage == 3 and not self.config.zero_optimization.gather_16bit_weights_on_model_save:
            warnings.warn("save_16bit_model: stage3_gather_16bit_weights_on_model_save is false, nothing saved "
                          "(set it to true to gather the weights)", stacklevel=2)
            return False
        state = self.consolidated_16bit_state_dict(exclude_frozen_parameters)
        error = None
        if self.dp.rank == 0:  # one writer, not one per replica
            try:
                atomic_save(state, save_path)
            except Exception as exc:  # noqa: BLE001 - every rank must learn of it, then it is raised
                error = exc
        if self.dp.any_rank(error is not None):  # as long as the write takes: the process group's timeout
            if error is not None:
                raise error
            raise RuntimeError(f"save_16bit_model: rank 0 could not write {save_path} (its error says why); nothing "
                               f"was written and training can go on")
        return True

    def save_checkpoint(self, save_dir: str | os.PathLike, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False,
                        async_save: bool | None = None) -> str:
        """Save the whole training state under `save_dir/tag` (default tag `global_step<N>`); all
        ranks call it. See docs/checkpoint.md for the layout and guarantees.

        Args:
            save_dir: the checkpoint directory (each node's own with use_node_local_storage).
            tag: the sub-directory name; `latest` then names it (with `save_latest`).
            client_state: your own JSON-serialisable values, returned by `load_checkpoint`.
            save_latest: point `save_dir/latest` at this tag once it is complete.
            exclude_frozen_parameters: leave out parameters with requires_grad=False.
            async_save: copy the state to host memory and write it in the background (default:
                the config's `checkpoint.async_save`); the next save, `load_checkpoint`,
                `wait_for_checkpoint()` and process exit wait for it.
        """
        from zero.checkpoint.training import save_checkpoint

        self._check_states_home("save_checkpoint()")
        self.wait_for_checkpoint()
        if async_save is None:
            async_save = self.config.checkpoint.async_save
        result = save_checkpoint(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters, async_save)
        if not async_save:
            return result
        self._pending_save = result
        return result.path

    def wait_for_checkpoint(self) -> str | None:
        """Wait for an asynchronous save to finish (raising its error, if any); returns its path."""
        pending, self._pending_save = self._pending_save, None
        return pending.wait() if pending is not None else None

    def load_checkpoint(self, load_dir: str | os.PathLike, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False) -> tuple[str, dict]:
        """Resume from `load_dir/tag` (default: the tag `latest` names), saved at any world size and
        stage; all ranks call it. Every check is made before anything changes.

        Returns:
            (the tag's path, the client_state saved with it)
        """
        from zero.checkpoint.training import load_checkpoint

        self._check_states_home("load_checkpoint()")
        self.wait_for_checkpoint()
        loaded = load_checkpoint(self, load_dir, tag, load_module_strict, load_optimizer_states,
                                 load_lr_scheduler_states, load_module_only)
        self.optimizer.at_boundary = self.is_gradient_accumulation_boundary()  # for the next backward
        return loaded

    def wall_clock_report(self, reset: bool = False) -> dict[str, float]:
        """Seconds spent in forward, backward and step since the last reset (with
        `wall_clock_breakdown: true`; backward is what `engine.backward` took: a plain
        `loss.backward()` is not timed); `communication_wait`, the part of them the host spent
        waiting for collectives (measured on gloo; under NCCL the waits are on the GPU's streams
        and this stays 0); and, with optimizer offload, inside the step: waiting for gradient
        copies, in CPU Adam, waiting for parameter copies.

        Args:
            reset: start counting again from zero after reading.
        """
        report = dict(self._times)
        report["communication_wait"] = self.comm.waited_s()  # inside forward, backward and step; gloo only
        host = self.optimizer.host_adam
        if host is not None:
            report.update(host.times)
        if reset:
            self._times = dict.fromkeys(self._times, 0.0)
            self.comm.reset_waited()
            if host is not None:
                host.times = dict.fromkeys(host.times, 0.0)
        return report

    def comm_report(self) -> dict[str, dict[str, int]]:
        """Logical calls/elements/bytes per collective during the last optimizer step's window
        (from the previous step's end to this step's end). See [Note: logical counts]. With a
        mesh: {"dp": that, "pp": the activations and gradients sent between stages, "tp": the
        tensor-parallel collectives} (see MeshTraffic)."""
        if self.traffic is None:
            return self._last_comm
        return {"dp": self._last_comm, **{d: dict(v) for d, v in self.traffic.last.items()}}

    # -- model states off the device ---------------------------------------------------------------

    def offload_states(self, include=None, device="cpu", pin_memory: bool = True, non_blocking: bool = False) -> None:
        """Move this rank's model states (DeepSpeed's `include`: optim_states, hp_params, lp_params,
        lp_grads, contiguous_grad_buffer; None: all) from the device to host memory, freeing
        their device memory until `reload_states()`; between a step and the next backward. States
        already in host memory (optimizer or parameter offload) stay. See [Note: states away] in
        zero/offload/relocation.py."""
        from zero.offload.relocation import StatesAway

        where = getattr(device, "value", device)
        if where == "none":
            warnings.warn("offload_states(device='none'): nothing to do", stacklevel=2)
            return
        if where != "cpu":
            raise ValueError(f"offload_states(device={device!r}): states can be moved to 'cpu' (host memory) only")
        if self.progress.backwards:
            raise RuntimeError(f"offload_states(): {self.progress.backwards} backward pass(es) since the last step, "
                               f"whose gradients may still be being reduced; offload after engine.step() at the "
                               f"end of the accumulation window")
        self.wait_for_checkpoint()  # an asynchronous save may still be copying them
        if self.__dict__.get("_away") is None:
            self._away = StatesAway(self.optimizer, [self.module, *getattr(self.module, "parts", [])])
        self._away.offload(include, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring back what `offload_states` moved to host memory (nothing if nothing is away)."""
        away = self.__dict__.get("_away")
        if away is not None:
            away.reload(non_blocking)

    def empty_partition_cache(self) -> None:
        """Release the gathered copies of stage-3 parameters (each is gathered again at its next
        use) and return the freed memory to the device (a no-op for stages 0-2)."""
        self.optimizer.storage.release_gathered()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def destroy(self) -> None:
        """Finish any checkpoint being written and release the gathered stage-3 parameters, before
        the engine is dropped (its memory goes with the engine object), and remove NVMe offload's
        swap files (the engine cannot step after this)."""
        self.wait_for_checkpoint()
        self.optimizer.storage.release_gathered()
        self.optimizer.storage.close()
        gc.collect()


    def compile(self, backend: str | Callable = "inductor", compile_kwargs: dict | None = None, schedule=None,
                compiled_autograd_enabled: bool = False, modules: list[nn.Module] | None = None) -> None:
        """Compile the model's repeated blocks with torch.compile, zero's hooks outside the graphs
        (DeepSpeed's signature; see [Note: compiled blocks] in zero/compilation.py).

        Args:
            backend: torch.compile's backend ("inductor", "aot_eager", a callable).
            compile_kwargs: torch.compile's other keyword arguments (mode, fullgraph, dynamic, ...).
            schedule: DeepCompile's pass schedule: not implemented (an error when given).
            compiled_autograd_enabled: refused: compiled autograd would trace zero's backward hooks.
            modules: zero's: the blocks to compile (default: found from the model's repeated modules).
        """
        from zero.compilation import backend_name, compile_blocks

        if schedule is not None:
            raise NotImplementedError("engine.compile(schedule=...): DeepCompile's pass schedules are not "
                                      "implemented; zero compiles each block with its hooks outside the graphs")
        if compiled_autograd_enabled:
            raise NotImplementedError("engine.compile(compiled_autograd_enabled=True): compiled autograd would trace "
                                      "zero's gradient hooks into the backward graph; leave it off")
        if self.mesh is not None and (self.mesh.pp > 1 or self.mesh.tp > 1):
            raise NotImplementedError("engine.compile with pipeline stages or tensor slicing is not implemented yet: "
                                      "their send/receive and DTensor collectives run inside the layers; compile "
                                      "without them, or run eagerly")
        if self.sequence_parallel_size > 1:
            raise NotImplementedError("engine.compile with sequence_parallel_size > 1 is not implemented yet: "
                                      "Ulysses' all-to-all runs inside the attention of each layer")
        mode = (compile_kwargs or {}).get("mode") if isinstance(compile_kwargs, dict) else None
        if mode in ("reduce-overhead", "max-autotune") and self.config.zero_optimization.stage == 3:
            raise ValueError(f"engine.compile(compile_kwargs={{'mode': {mode!r}}}): that mode records CUDA graphs, "
                             f"which need each parameter at a fixed address, and stage 3 frees and gathers them "
                             f"again; use 'max-autotune-no-cudagraphs' or the default mode")
        hf = getattr(self.module, "config", None)
        if getattr(hf, "use_cache", False) is True:  # a key/value cache in training forwards makes each layer
            hf.use_cache = False  # a graph of its own (its layer index); generate() passes use_cache itself
            if self.dp.rank == 0:
                log.info("zero: compile sets the model's config.use_cache = False for training (HF Trainer does the "
                         "same under gradient checkpointing)")
        self._compiled_blocks = compile_blocks(self.module, backend, compile_kwargs, modules)
        if self.dp.rank == 0:
            log.info("zero: compiled %d block(s) (%s) with backend %r", len(self._compiled_blocks),
                     ", ".join(sorted({type(b).__name__ for b in self._compiled_blocks})) or "none found",
                     backend_name(backend))

    @property
    def is_compiled(self) -> bool:
        """Whether `compile` (or the config's compile.enabled) compiled the model's blocks."""
        return bool(getattr(self, "_compiled_blocks", None))
