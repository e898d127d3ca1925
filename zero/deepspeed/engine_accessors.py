"""DeepSpeedEngine's config accessors (`engine.fp16_enabled()`, `engine.zero_offload_optimizer()`, ...),
mixed into `DeepSpeedEngine` (zero/deepspeed/engine.py), the facade over zero's `Engine`.

Each accessor reads `engine._config`, a `DeepSpeedConfig` (zero/deepspeed/runtime/config.py) viewing
the engine's `ZeroConfig` (`engine.config`) over its data-parallel ranks, as DeepSpeed's accessors
read DeepSpeed's, and returns what DeepSpeed's returns for the same config. For a DeepSpeed feature
zero does not run (profilers, autotuning, curriculum learning, compression, DeepCompile, ...) that
is DeepSpeed's value with the feature off: `load_config` refuses to enable the ones that would
change the results and warns about the others (see [Note: DeepSpeedConfig is a view] in
zero/deepspeed/runtime/config.py).

The view is built on first use and again whenever `engine.config` is replaced by another object
(`set_train_batch_size` does); it is read-only: DeepSpeed code that assigns to it
(`engine._config.train_batch_size = n`) gets an error saying what to call instead, since the engine
would not train with the new value. Methods that act on the engine's state (step, checkpoints,
batch-size changes, collectives) are in zero/engine/loop.py and zero/deepspeed/engine_methods.py.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from zero.config import ZeroConfig
    from zero.deepspeed.runtime.config import DeepSpeedConfig

# DeepSpeed's default of torch_autocast.lower_precision_safe_modules (torch_autocast is refused here)
_AUTOCAST_SAFE_MODULES = ["torch.nn.modules.linear.Linear", "torch.nn.modules.conv.Conv1d",
                          "torch.nn.modules.conv.Conv2d", "torch.nn.modules.conv.Conv3d"]


class ConfigAccessors:
    """DeepSpeedEngine's config accessors, for a class that holds its `ZeroConfig` at `self.config`
    (and, optionally, its data-parallel `Comm` at `self.comm` and the optimizer object passed to
    `initialize` at `self.client_optimizer`)."""

    config: ZeroConfig

    # -- the view ------------------------------------------------------------------------------

    @property
    def _config(self) -> DeepSpeedConfig:
        """DeepSpeed's parsed config (`DeepSpeedConfig`) of `self.config`, built once per config object."""
        cached = self.__dict__.get("_deepspeed_config")
        if cached is None or cached[0] is not self.config:
            from zero.deepspeed.runtime.config import DeepSpeedConfig  # zero.deepspeed imports the engine

            comm = self.__dict__.get("dp") or self.__dict__.get("comm")  # every data rank, replicas too
            world = comm.world_size if comm is not None else 1
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            cached = self.__dict__["_deepspeed_config"] = (self.config, DeepSpeedConfig.of(self.config, world, rank))
        return cached[1]

    # -- batch and training loop ---------------------------------------------------------------

    def train_batch_size(self) -> int:
        """Samples per optimizer step over all data-parallel ranks."""
        return self._config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per forward on one rank."""
        return self._config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step."""
        return self._config.gradient_accumulation_steps

    def managed_gradient_accumulation(self) -> bool:
        """Whether the engine tracks accumulation boundaries itself (always, in zero)."""
        return self._config.managed_gradient_accumulation

    def dataloader_drop_last(self) -> bool:
        return self._config.dataloader_drop_last

    def steps_per_print(self) -> Optional[int]:
        return self._config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self._config.wall_clock_breakdown

    def memory_breakdown(self) -> bool:
        return self._config.memory_breakdown

    def dump_state(self) -> bool:
        return self._config.dump_state

    def log_level(self) -> Optional[str]:
        """DeepSpeed's log_level key (not in zero's config): None."""
        return self._config.log_level

    # -- gradients and communication -----------------------------------------------------------

    def gradient_clipping(self) -> float:
        """The global gradient-norm bound; 0 means no clipping."""
        return self._config.gradient_clipping

    def gradient_predivide_factor(self) -> float:
        return self._config.gradient_predivide_factor

    def postscale_gradients(self) -> bool:
        """True unless prescale_gradients: gradients are divided by the world size after the reduction."""
        return not self._config.prescale_gradients

    @property
    def communication_data_type(self) -> torch.dtype:
        """The dtype gradients are reduced in: communication_data_type, else the training dtype."""
        given = self._config.communication_data_type
        if given is not None:
            return given
        return torch.float16 if self.fp16_enabled() else torch.bfloat16 if self.bfloat16_enabled() else torch.float32

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """(the model's dtype, the gradient accumulation dtype)."""
        model = torch.float16 if self.fp16_enabled() else torch.bfloat16 if self.bfloat16_enabled() else torch.float32
        accum = self._config.grad_accum_dtype
        if accum is None:
            return model, model
        from zero.deepspeed.runtime.config import DtypeEnum

        return model, DtypeEnum(accum).value

    def sparse_gradients_enabled(self) -> bool:
        return self._config.sparse_gradients_enabled

    # -- precision -----------------------------------------------------------------------------

    def fp16_enabled(self) -> bool:
        return self._config.float16_config.enabled

    def bfloat16_enabled(self) -> bool:
        return self._config.bfloat16_config.enabled

    def fp16_auto_cast(self) -> bool:
        """Whether forward casts floating-point inputs to fp16."""
        return self._config.float16_config.auto_cast

    def fp16_master_weights_and_gradients(self) -> bool:
        return self._config.float16_config.fp16_master_weights_and_grads

    def bf16_master_weights_and_gradients(self) -> bool:
        return self._config.bfloat16_config.bf16_master_weights_and_grads

    def bf16_optimizer_states(self) -> bool:
        return self._config.bfloat16_config.bf16_optimizer_states

    def dynamic_loss_scale(self) -> bool:
        """Whether fp16.loss_scale is 0, which selects dynamic loss scaling."""
        return self._config.float16_config.loss_scale == 0

    def initial_dynamic_scale(self) -> int:
        """2**fp16.initial_scale_power."""
        return self._config.float16_config.initial_dynamic_scale()

    def dynamic_loss_scale_args(self) -> dict[str, Any]:
        """The dynamic loss scaler's settings under DeepSpeed's keys (init_scale, scale_window,
        delayed_shift, consecutive_hysteresis, min_scale)."""
        return self._config.float16_config.dynamic_loss_scale_args()

    def amp_enabled(self) -> bool:
        return self._config.amp_enabled

    def amp_params(self) -> Any:
        return self._config.amp_params

    def torch_autocast_enabled(self) -> bool:
        return self._config.torch_autocast_enabled

    def torch_autocast_dtype(self) -> Optional[torch.dtype]:
        return self._config.torch_autocast_dtype

    def torch_autocast_lower_precision_safe_modules(self) -> list[str]:
        given = self._config.torch_autocast_lower_precision_safe_modules
        return list(_AUTOCAST_SAFE_MODULES) if given is None else given

    # -- optimizer and scheduler ---------------------------------------------------------------

    def optimizer_name(self) -> Optional[str]:
        """The class name of the optimizer object passed to initialize, else the config's optimizer
        type (lower case for DeepSpeed's own: "adamw"), else None."""
        client = self.__dict__.get("client_optimizer")
        return type(client).__name__ if client is not None else self._config.optimizer_name

    def optimizer_params(self) -> Optional[dict]:
        """The config's optimizer.params, as given."""
        return self._config.optimizer_params

    def optimizer_legacy_fusion(self) -> bool:
        return self._config.optimizer_legacy_fusion

    def scheduler_name(self) -> Optional[str]:
        return self._config.scheduler_name

    def scheduler_params(self) -> Optional[dict]:
        """The config's scheduler.params, as given."""
        return self._config.scheduler_params

    def zero_allow_untested_optimizer(self) -> bool:
        return self._config.zero_allow_untested_optimizer

    def zero_force_ds_cpu_optimizer(self) -> bool:
        return self._config.zero_force_ds_cpu_optimizer

    # -- ZeRO ----------------------------------------------------------------------------------

    def zero_optimization(self) -> bool:
        """Whether ZeRO is on (stage > 0); the section itself is `engine._config.zero_config`."""
        return self._config.zero_enabled

    def zero_optimization_stage(self) -> int:
        return self._config.zero_optimization_stage

    def zero_optimization_partition_gradients(self) -> bool:
        """Stage 2 or 3."""
        return self.zero_optimization_stage() >= 2

    def zero_optimization_partition_weights(self) -> bool:
        """Stage 3."""
        return self.zero_optimization_stage() >= 3

    def is_first_weights_partition_group(self) -> bool:
        """DeepSpeed's name for zero_optimization_partition_weights()."""
        return self.zero_optimization_partition_weights()

    def zero_offload_optimizer(self):
        """The `offload_optimizer` section (DeepSpeedZeroOffloadOptimizerConfig), or None."""
        return self._config.zero_config.offload_optimizer

    def zero_offload_param(self):
        """The `offload_param` section (DeepSpeedZeroOffloadParamConfig), or None."""
        return self._config.zero_config.offload_param

    def zero_cpu_offload(self) -> bool:
        """Whether optimizer state is offloaded to the CPU."""
        offload = self._config.zero_config.offload_optimizer
        return offload is not None and offload.device == "cpu"

    def zero_use_cpu_optimizer(self) -> bool:
        """Whether the optimizer steps on the CPU (optimizer state offloaded)."""
        offload = self._config.zero_config.offload_optimizer
        return offload is not None and offload.device in ("cpu", "nvme")

    def zero_nvme_offload_optimizer(self) -> bool:
        """Whether optimizer state is swapped to NVMe: never in zero (the config refuses it)."""
        return False

    def zero_partial_offload(self) -> float:
        """The share of optimizer state offloaded (1.0: all)."""
        return getattr(self._config.zero_config.offload_optimizer, "ratio", 1.0)

    def super_offload(self) -> bool:
        return getattr(self._config.zero_config.offload_optimizer, "super_offload", False)

    def cpuadam_cores_perc(self) -> float:
        return getattr(self._config.zero_config.offload_optimizer, "cpuadam_cores_perc", 0.9)

    def zero_sub_group_size(self) -> int:
        return self._config.zero_config.sub_group_size

    def zero_reduce_bucket_size(self) -> int:
        return self._config.zero_config.reduce_bucket_size

    def zero_allgather_bucket_size(self) -> int:
        return self._config.zero_config.allgather_bucket_size

    def zero_reduce_scatter(self) -> bool:
        return self._config.zero_config.reduce_scatter

    def zero_overlap_comm(self) -> bool:
        return self._config.zero_config.overlap_comm

    def zero_contiguous_gradients(self) -> bool:
        return self._config.zero_config.contiguous_gradients

    def zero_allgather_partitions(self) -> bool:
        return self._config.zero_config.allgather_partitions

    def zero_multi_rank_bucket_allreduce(self) -> bool:
        return self._config.zero_config.use_multi_rank_bucket_allreduce

    def zero_round_robin_gradients(self) -> bool:
        return self._config.zero_config.round_robin_gradients

    def zero_load_from_fp32_weights(self) -> bool:
        return self._config.zero_config.load_from_fp32_weights

    def zero_elastic_checkpoint(self) -> bool:
        return self._config.zero_config.elastic_checkpoint

    def zero_prefetch_bucket_size(self) -> int:
        return self._config.zero_config.prefetch_bucket_size

    def zero_param_persistence_threshold(self) -> int:
        return self._config.zero_config.param_persistence_threshold

    def zero_model_persistence_threshold(self) -> int:
        return self._config.zero_config.model_persistence_threshold

    def zero_max_live_parameters(self) -> int:
        return self._config.zero_config.max_live_parameters

    def zero_max_reuse_distance(self) -> int:
        return self._config.zero_config.max_reuse_distance

    def zero_module_granularity_threshold(self) -> int:
        return self._config.zero_config.module_granularity_threshold

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return self._config.zero_config.gather_16bit_weights_on_model_save

    def zero_ignore_unused_parameters(self) -> bool:
        return self._config.zero_config.ignore_unused_parameters

    def zero_legacy_stage1(self) -> bool:
        return self._config.zero_config.legacy_stage1

    def zero_hpz_partition_size(self) -> int:
        return self._config.zero_config.zero_hpz_partition_size

    def zero_quantized_weights(self) -> bool:
        return self._config.zero_config.zero_quantized_weights

    def zero_quantized_nontrainable_weights(self) -> bool:
        return self._config.zero_config.zero_quantized_nontrainable_weights

    def zero_quantized_gradients(self) -> bool:
        return self._config.zero_config.zero_quantized_gradients

    def zeropp_loco_param(self) -> Optional[dict]:
        return self._config.zero_config.zeropp_loco_param

    def mics_shard_size(self) -> int:
        return self._config.mics_shard_size

    def zero_log_trace_cache_warnings(self) -> bool:
        return self._config.zero_config.log_trace_cache_warnings

    def zero_allgather_sequential(self) -> bool:
        return self._config.zero_config.allgather_sequential

    def zero_compute_grad_norm(self) -> bool:
        return self._config.zero_config.compute_grad_norm

    def zero_parameter_alignment(self) -> bool:
        return self._config.zero_config.parameter_alignment

    def zero_save_muon_momentum_buffer_in_memory(self) -> bool:
        return self._config.zero_config.save_muon_momentum_buffer_in_memory

    def is_sanity_checks_enabled(self) -> bool:
        return self._config.zero_config.enable_sanity_checks

    def zenflow_config(self) -> Optional[dict]:
        return self._config.zero_config.zenflow

    def aio_config(self) -> dict:
        """DeepSpeed's async I/O settings for NVMe (zero has no NVMe offload: the defaults)."""
        return self._config.aio_config

    def swap_tensor_config(self) -> None:
        """DeepSpeed's NVMe swap settings: none in zero."""
        return None

    # -- checkpoints ---------------------------------------------------------------------------

    def checkpoint_tag_validation_enabled(self) -> bool:
        return self._config.checkpoint_tag_validation_enabled

    def checkpoint_tag_validation_fail(self) -> bool:
        return self._config.checkpoint_tag_validation_fail

    def checkpoint_serialization_enabled(self) -> bool:
        return self._config.checkpoint_config["checkpoint_serialization"]

    def checkpoint_writer_enabled(self) -> bool:
        return self._config.checkpoint_config["writer"] is not None

    def load_universal_checkpoint(self) -> bool:
        """The config's checkpoint.load_universal (refused when true)."""
        return self._config.load_universal_checkpoint

    def use_node_local_storage(self) -> bool:
        return self._config.use_node_local_storage

    # -- profiling and autotuning (not in zero: off) ---------------------------------------------

    def flops_profiler_enabled(self) -> bool:
        return self._config.flops_profiler_config.enabled or self.autotuning_enabled()

    def flops_profiler_recompute_fwd_factor(self) -> float:
        return self._config.flops_profiler_config.recompute_fwd_factor

    def flops_profiler_profile_step(self) -> int:
        if self._config.autotuning_config.enabled:
            return self.autotuning_start_profile_step()
        return self._config.flops_profiler_config.profile_step

    def flops_profiler_module_depth(self) -> int:
        return self._config.flops_profiler_config.module_depth

    def flops_profiler_top_modules(self) -> int:
        return self._config.flops_profiler_config.top_modules

    def flops_profiler_detailed(self) -> bool:
        return False if self._config.autotuning_config.enabled else self._config.flops_profiler_config.detailed

    def flops_profiler_output_file(self) -> Optional[str]:
        return self._config.flops_profiler_config.output_file

    def autotuning_enabled(self) -> bool:
        return self._config.autotuning_config.enabled

    def autotuning_start_profile_step(self) -> int:
        return self._config.autotuning_config.start_profile_step

    def autotuning_end_profile_step(self) -> int:
        return self._config.autotuning_config.end_profile_step

    def autotuning_metric(self) -> str:
        return self._config.autotuning_config.metric

    def autotuning_metric_path(self) -> str:
        return self._config.autotuning_config.metric_path or os.path.join(os.getcwd(), "autotuning_metric.json")

    def autotuning_model_info_path(self) -> str:
        return self._config.autotuning_config.model_info_path or os.path.join(os.getcwd(),
                                                                               "autotuning_model_info.json")

    def autotuning_profile_model_info(self) -> bool:
        info = self._config.autotuning_config.model_info
        return self.autotuning_enabled() and bool(info) and bool(info.get("profile", False))

    # -- data efficiency, curriculum, layer drop, eigenvalue (not in zero: off); elasticity -------

    def data_efficiency_enabled(self) -> bool:
        return self._config.data_efficiency_enabled

    def data_efficiency_config(self) -> dict:
        return self._config.data_efficiency_config

    def data_sampling_enabled(self) -> bool:
        return self._config.data_efficiency_config["data_sampling"]["enabled"]

    def data_sampling_config(self) -> dict:
        return self._config.data_efficiency_config["data_sampling"]

    def curriculum_learning_enabled(self) -> bool:
        return self._config.data_efficiency_config["data_sampling"]["curriculum_learning"]["enabled"]

    def curriculum_learning_config(self) -> dict:
        return self._config.data_efficiency_config["data_sampling"]["curriculum_learning"]

    def random_ltd_enabled(self) -> bool:
        return self._config.data_efficiency_config["data_routing"]["random_ltd"]["enabled"]

    def random_ltd_config(self) -> dict:
        return self._config.data_efficiency_config["data_routing"]["random_ltd"]

    def curriculum_enabled_legacy(self) -> bool:
        return self._config.curriculum_enabled_legacy

    def curriculum_params_legacy(self) -> Any:
        return self._config.curriculum_params_legacy

    def pld_enabled(self) -> bool:
        return self._config.pld_enabled

    def pld_params(self) -> Any:
        return self._config.pld_params

    def pld_theta(self) -> float:
        """DeepSpeed's default theta of progressive layer drop (which zero refuses)."""
        return 1.0

    def pld_gamma(self) -> float:
        """DeepSpeed's default gamma of progressive layer drop (which zero refuses)."""
        return 0.001

    def get_pld_theta(self) -> None:
        """The current layer-keep probability of progressive layer drop: None, it is never on."""
        return None

    def eigenvalue_enabled(self) -> bool:
        return self._config.eigenvalue_enabled

    def eigenvalue_verbose(self) -> bool:
        return self._config.eigenvalue_verbose

    def eigenvalue_max_iter(self) -> int:
        return self._config.eigenvalue_max_iter

    def eigenvalue_tol(self) -> float:
        return self._config.eigenvalue_tol

    def eigenvalue_stability(self) -> float:
        return self._config.eigenvalue_stability

    def eigenvalue_gas_boundary_resolution(self) -> int:
        return self._config.eigenvalue_gas_boundary_resolution

    def eigenvalue_layer_name(self) -> str:
        return self._config.eigenvalue_layer_name

    def eigenvalue_layer_num(self) -> int:
        return self._config.eigenvalue_layer_num

    def elasticity_enabled(self) -> bool:
        return self._config.elasticity_enabled

    def is_elastic_model_parallel_supported(self) -> bool | None:
        """With elasticity on: whether its version takes model parallelism (0.2); else None."""
        if not self._config.elasticity_enabled:
            return None
        return self._config.elasticity_version >= 0.2

    def quantize_training(self) -> tuple:
        """MoQ's weight quantization settings (DeepSpeed 0.17; compression is refused here): in-forward,
        enabled, groups, fp16 mixed, change ratio, type, rounding, verbose, kernel."""
        shared = self._config.compression_config["weight_quantization"]["shared_parameters"]
        return tuple(shared[k] for k in ("quantize_weight_in_forward", "enabled", "quantize_groups",
                                         "fp16_mixed_quantize", "quantize_change_ratio", "quantization_type",
                                         "rounding", "quantize_verbose", "quantizer_kernel"))

    def graph_harvesting(self) -> bool:
        return self._config.graph_harvesting

    # -- compilation and tensor parallelism ------------------------------------------------------

    def is_deepcompile_enabled(self) -> bool:
        return self._config.compile_config.deepcompile

    def is_deepcompile_active(self) -> bool:
        """Whether a DeepCompile graph runs now: never (the config refuses DeepCompile)."""
        return False

    def compile_zero_optimization_stage(self) -> bool:
        """Whether DeepCompile's passes include a ZeRO pass."""
        passes = self._config.compile_config.passes or []
        return "z1" in passes or "z3" in passes

    def compile_autotp(self) -> bool:
        return "autotp" in (self._config.compile_config.passes or [])

    def compile_autosp(self) -> bool:
        return "autosp" in (self._config.compile_config.passes or [])

    def uses_parallelization_pass_only(self) -> bool:
        return self.compile_autosp() or self.compile_autotp()

    def autotp_size(self) -> int:
        """tensor_parallel.size (DeepSpeed's autotp_size) when the config gives it, else 0."""
        return self._config.tensor_parallel_config.autotp_size

    def tensor_parallel_config(self):
        return self._config.tensor_parallel_config
