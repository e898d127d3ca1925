"""DeepSpeedEngine's methods that act (the config accessors are in zero/deepspeed/engine_accessors.py).

`DeepSpeedEngine` (zero/deepspeed/engine.py) inherits them. Each has DeepSpeed's signature and
meaning, built on the engine's own pieces (its optimizer and storage, its progress, its mesh): the
module's state dict, batch-size changes, rank queries, the data loader, DeepSpeed's collectives on
tensors of one's own, and the old names of methods that have new ones. Moving model states off the
device and back (`offload_states` / `reload_states`, see [Note: states away] in
zero/offload/relocation.py) is zero's `Engine`'s own (zero/engine/engine.py).
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import os

import torch
import torch.distributed as dist

from zero.features import refused_engine_methods

log = logging.getLogger("zero")


class DeepSpeedMethods:
    """Mixed into DeepSpeedEngine, over zero.engine.Engine."""

    # -- the module's state ------------------------------------------------------------------------

    def module_state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False,
                          exclude_frozen_parameters: bool = False) -> dict:
        """The wrapped module's state dict (`module.state_dict()`), without frozen parameters if
        asked. Under stage 3 every rank calls it and gets the whole values in host memory (each
        parameter gathered in turn and copied), where DeepSpeed gives this rank's empty placeholders."""
        self._check_states_home("module_state_dict()")
        if self.config.zero_optimization.stage == 3:
            from zero.init import GatheredParameters

            out = {} if destination is None else destination
            for name, value in self.module.state_dict(prefix=prefix, keep_vars=True).items():
                if getattr(value, "_zero", None) is not None:  # gathered one at a time, kept in host memory
                    with GatheredParameters([value]):
                        value = value.detach().to("cpu", copy=True)
                out[name] = value if keep_vars or not isinstance(value, torch.Tensor) else value.detach()
        else:
            out = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            for name, p in self.module.named_parameters():
                if not p.requires_grad:
                    out.pop(prefix + name, None)
        return out

    def load_module_state_dict(self, checkpoint: dict, strict: bool = True, custom_load_fn=None,
                               fetch_z3_params: bool = False, z3_params_to_fetch=None, allowed_missing_keys=None):
        """Load `checkpoint["module"]` into the wrapped module (sharded parameters take their
        part of each value, see zero/init.py), or call `custom_load_fn(src=..., dst=module)`.
        Every rank calls it. `allowed_missing_keys`: keys that may be missing from a strict load."""
        self._check_states_home("load_module_state_dict()")
        if not isinstance(checkpoint, dict) or "module" not in checkpoint:
            raise ValueError(f"load_module_state_dict(checkpoint) takes a dict with the module's state under "
                             f"'module' (as DeepSpeed's), got {type(checkpoint).__name__}"
                             f"{' with keys ' + str(sorted(checkpoint)[:5]) if isinstance(checkpoint, dict) else ''}")
        state = checkpoint["module"]
        if custom_load_fn is not None:
            from zero.init import GatheredParameters

            with GatheredParameters(list(self.module.parameters()), modifier_rank=0):
                return custom_load_fn(src=state, dst=self.module)
        result = self.module.load_state_dict(state, strict=strict and allowed_missing_keys is None)
        if strict and allowed_missing_keys is not None:
            missing = set(result.missing_keys) - set(allowed_missing_keys)
            if missing or result.unexpected_keys:
                raise RuntimeError(f"load_module_state_dict: the state does not match the module beyond "
                                   f"allowed_missing_keys: missing {sorted(missing)}, unexpected "
                                   f"{sorted(result.unexpected_keys)}")
        return result

    def save_fp16_model(self, save_dir: str | os.PathLike, save_filename: str = "model.safetensors") -> bool:
        """The old name of `save_16bit_model`."""
        return self.save_16bit_model(save_dir, save_filename)

    # -- batch sizes ---------------------------------------------------------------------------------

    def get_batch_info(self) -> tuple[int, int, int]:
        """(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)."""
        c = self.config
        return c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch size by changing the gradient accumulation steps (the
        micro-batch stays); at an accumulation boundary only. ValueError if it is not a multiple
        of micro-batch x data-parallel ranks."""
        per_step = self.config.train_micro_batch_size_per_gpu * self.dp.world_size
        if not isinstance(train_batch_size, int) or train_batch_size <= 0 or train_batch_size % per_step:
            raise ValueError(f"set_train_batch_size({train_batch_size!r}): the train batch size must be a positive "
                             f"multiple of train_micro_batch_size_per_gpu x data-parallel ranks = {per_step}")
        self._set_accumulation(train_batch_size // per_step, "set_train_batch_size")

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """Change the micro-batch size, keeping the accumulation steps (the global batch changes
        with it); the data loader initialize made keeps its batch size, as in DeepSpeed."""
        if not isinstance(micro_batch_size, int) or micro_batch_size <= 0:
            raise ValueError(f"set_train_micro_batch_size({micro_batch_size!r}): expected a positive int")
        c = self.config
        self.config = c.model_copy(update={
            "train_micro_batch_size_per_gpu": micro_batch_size,
            "train_batch_size": micro_batch_size * c.gradient_accumulation_steps * self.dp.world_size})

    def _set_accumulation(self, steps: int, what: str) -> None:
        c = self.config
        if self.progress.micro_steps % c.gradient_accumulation_steps:
            raise RuntimeError(f"{what}: inside an accumulation window ({self.progress.micro_steps % c.gradient_accumulation_steps}"
                               f" of {c.gradient_accumulation_steps} micro-steps done); change it after a step")
        if self.pipeline is not None and steps != c.gradient_accumulation_steps:
            raise RuntimeError(f"{what}: a pipeline engine's micro-batches per batch are fixed when it is built")
        if (steps > 1) != (c.gradient_accumulation_steps > 1) and c.dtype != torch.float32 and not c.fp16.enabled:
            raise RuntimeError(f"{what}: going from {c.gradient_accumulation_steps} to {steps} accumulation steps "
                               f"changes the gradient buffers' dtype (bf16 gradients accumulate in fp32 across "
                               f"micro-batches); set gradient_accumulation_steps to > 1 in the config if the run "
                               f"will switch")
        self.config = c.model_copy(update={"gradient_accumulation_steps": steps,
                                           "train_batch_size": steps * c.train_micro_batch_size_per_gpu * self.dp.world_size})
        self.progress.accumulation = steps
        self.progress.micro_steps = self.progress.global_steps * steps
        opt = self.optimizer
        if not c.fp16.enabled:
            opt.options = dataclasses.replace(opt.options, accumulation=steps)
        opt.loss_scaler.accumulation = steps
        opt.at_boundary = self.is_gradient_accumulation_boundary()

    # -- ranks and groups ------------------------------------------------------------------------------

    def _coordinate(self, dim: str) -> int:
        return self.mesh.coordinate(dim) if self.mesh is not None else 0

    def get_data_parallel_rank(self) -> int:
        return self.dp.rank

    def get_tensor_parallel_rank(self) -> int:
        return self._coordinate("tp")

    def get_model_parallel_rank(self) -> int:
        """The rank among the model-parallel (tensor-slice) ranks (0 without tensor slicing)."""
        return self._coordinate("tp")

    def get_pipeline_parallel_rank(self) -> int:
        return self._coordinate("pp")

    def get_sequence_parallel_group(self):
        """The sequence-parallel group (`sequence_parallel_size` consecutive ranks), None when it is
        off (DeepSpeed's value then)."""
        return getattr(self, "seq_parallel_group", None)

    @property
    def mp_world_size(self) -> int:
        return self.mesh.tp if self.mesh is not None else 1

    @property
    def data_parallel_group(self):
        return self.dp.group if self.dp.group is not None else (dist.group.WORLD if dist.is_initialized() else None)

    # -- data ------------------------------------------------------------------------------------------

    def deepspeed_io(self, dataset, batch_size: int | None = None, route=None, pin_memory: bool = True,
                     data_sampler=None, collate_fn=None, num_local_io_workers: int | None = None):
        """A loader over `dataset` giving each data-parallel rank its own micro-batches (default
        size: train_micro_batch_size_per_gpu), resumable from checkpoints as initialize's."""
        from zero.data import ResumableLoader

        if data_sampler is not None:
            return torch.utils.data.DataLoader(dataset, batch_size=batch_size or self.config.train_micro_batch_size_per_gpu,
                                               sampler=data_sampler, collate_fn=collate_fn, pin_memory=pin_memory,
                                               num_workers=num_local_io_workers or 0)
        return ResumableLoader(dataset, batch_size=batch_size or self.config.train_micro_batch_size_per_gpu,
                               num_replicas=self.dp_world_size, rank=self.parallel.index("batch"),
                               collate_fn=collate_fn, drop_last=self.config.dataloader_drop_last)

    @staticmethod
    def is_map_style_dataset(obj) -> bool:
        return hasattr(obj, "__getitem__") and hasattr(obj, "__len__")

    @staticmethod
    def is_iterable_style_dataset(obj) -> bool:
        return isinstance(obj, torch.utils.data.IterableDataset)

    def allreduce_gradients(self, bucket_size=None) -> None:
        """Nothing to do: gradients are reduced by the stage's hooks during backward and at the
        step (DeepSpeed's engine.backward calls this itself; scripts that call it too keep
        working)."""
        return None

    def set_data_post_process_func(self, post_process_func) -> None:
        """Apply `post_process_func` to every batch of the loader initialize made (if any)."""
        if self.training_dataloader is not None:
            self.training_dataloader.post_process_func = post_process_func

    # -- collectives of DeepSpeed's non-ZeRO path, on tensors the caller holds -----------------------

    def all_gather_scalar(self, value: torch.Tensor, dp_group) -> list[torch.Tensor]:
        """`value` of every rank of `dp_group`, in rank order."""
        out = [torch.zeros_like(value) for _ in range(dist.get_world_size(group=dp_group) if dist.is_initialized()
                                                      else 1)]
        if len(out) == 1:
            out[0].copy_(value)
        else:
            dist.all_gather(out, value, group=dp_group)
        return out

    def allreduce_bucket(self, bucket: list[torch.Tensor], dp_group, dp_world_size: int | None = None) -> torch.Tensor:
        """The mean over `dp_group` of the tensors in `bucket`, flattened into one tensor (reduced
        in communication_data_type, divided by gradient_predivide_factor before and the rest
        after, as the engine divides gradients)."""
        flat = torch.cat([t.reshape(-1) for t in bucket])
        reduced = flat.to(self.config.communication_dtype)
        world = dp_world_size or (dist.get_world_size(group=dp_group) if dist.is_initialized() else 1)
        predivide = self.config.gradient_predivide_factor
        reduced.div_(predivide)
        if world > 1:
            dist.all_reduce(reduced, group=dp_group)
        reduced.mul_(predivide / world)
        return reduced.to(flat.dtype) if reduced.dtype != flat.dtype else reduced

    def allreduce_and_copy(self, small_bucket: list[torch.Tensor], dp_group, dp_world_size: int | None = None) -> None:
        """Replace each tensor of `small_bucket` by its mean over `dp_group`."""
        reduced = self.allreduce_bucket(small_bucket, dp_group, dp_world_size)
        for t, part in zip(small_bucket, torch.split(reduced, [t.numel() for t in small_bucket])):
            t.copy_(part.view_as(t))

    def allreduce_no_retain(self, bucket: list[torch.Tensor], dp_group, numel_per_bucket: int = 500_000_000,
                            dp_world_size: int | None = None) -> None:
        """`allreduce_and_copy` in pieces of about `numel_per_bucket` elements."""
        piece, numel = [], 0
        for t in bucket:
            piece.append(t)
            numel += t.numel()
            if numel > numel_per_bucket:
                self.allreduce_and_copy(piece, dp_group, dp_world_size)
                piece, numel = [], 0
        if piece:
            self.allreduce_and_copy(piece, dp_group, dp_world_size)

    # -- reports and queries -----------------------------------------------------------------------

    def get_type(self) -> list[str | None]:
        """Per param group, the optimizer's type (the config's, or the client optimizer's class)."""
        kind = self.config.optimizer.type if self.config.optimizer is not None else (
            type(self.client_optimizer).__name__ if self.client_optimizer is not None else None)
        return [kind for _ in self.optimizer.param_groups]

    def get_wall_clock_timers(self) -> dict[str, float]:
        """A snapshot of the engine's wall-clock timers, in seconds (see wall_clock_report)."""
        return self.wall_clock_report()

    def print_forward_breakdown(self, fwd_time: float) -> None:
        """Log the forward time (ms) on rank 0 (zero has no mixture-of-experts layers to break it into)."""
        from zero.deepspeed.utils import log_dist

        log_dist(f"time (ms) | fwd: {fwd_time:.2f}", ranks=[0])

    def get_compile_time(self) -> dict:
        """Time per DeepCompile pass: none ran."""
        return {}

    def collect_python_gc(self) -> int:
        """Run Python's cyclic garbage collector now; returns the objects collected."""
        return gc.collect()


def _not_available(name: str, reason: str):
    def method(self, *args, **kwargs):
        from zero.deepspeed._missing import NotAvailableError

        raise NotAvailableError(f"engine.{name} is not available in zero: {reason}")

    method.__name__ = name
    method.__doc__ = f"Not available in zero: {reason}"
    return method


# DeepSpeedEngine members with no counterpart here: each raises, saying why, when called (from the one
# feature table: see [Note: the feature table] in zero/features.py)
NOT_AVAILABLE = refused_engine_methods()
for _name, _reason in NOT_AVAILABLE.items():
    setattr(DeepSpeedMethods, _name, _not_available(_name, _reason))

