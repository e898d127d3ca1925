"""The `pipeline` and `tensor_parallel` sections: how the ranks split into a (pp, dp, tp) mesh.

[Note: the parallel mesh]
The (pp, dp, tp) case of [Note: parallel dimensions] (zero/parallel/dims.py), which a pipeline or
tensor slices build as a torch DeviceMesh. World = P x D x T ranks: P pipeline stages (`pipeline.stages`), T tensor slices
(`tensor_parallel.size`) and D = world / (P x T) data-parallel replicas, over which ZeRO
partitions. Ranks are laid out tp fastest, then dp, then pp (rank = (pp * D + dp) * T + tp), so
a tensor-parallel group, whose collectives run inside every layer, is the closest set of ranks
(the GPUs of one node), and a pipeline stage's ranks are contiguous. The batch rule counts the D
replicas only: train_batch_size = micro x accumulation x D, and with a pipeline the accumulation
steps are the micro-batches each optimizer step runs through the pipeline.
"""
from __future__ import annotations

import re
from typing import Any, Literal, Optional

from pydantic import Field, field_validator, model_validator

from zero.config.sections import _Section


class PipelineConfig(_Section):
    """`pipeline`: pipeline parallelism over `stages` groups of consecutive layers (a
    `zero.pipe.PipelineModule` model; see docs/parallelism.md)."""

    stages: Optional[int] = Field(None, ge=1, description="Pipeline stages P; null (or \"auto\"): the model's "
                                  "own (a PipelineModule's num_stages), else 1.")
    schedule: Literal["1f1b", "gpipe", "interleaved_1f1b"] = Field(
        "1f1b", description="Order of the micro-batches' forwards and backwards: '1f1b' (one forward, one "
        "backward: at most P micro-batches' activations alive), 'gpipe' (all forwards, then all backwards) or "
        "'interleaved_1f1b' (each rank holds `virtual_stages` non-consecutive parts: a smaller bubble).")
    micro_batches: Optional[int] = Field(None, ge=1, description="Micro-batches per optimizer step; the same "
                                         "number as gradient_accumulation_steps (give either, or both equal).")
    virtual_stages: Optional[int] = Field(None, ge=1, description="Parts per rank (interleaved_1f1b: >= 2); null: "
                                          "the PipelineModule's virtual_stages, which must agree when given.")
    partition_method: Optional[str] = Field(None, description="How layers are split between stages: "
                                            "'parameters' (balance trainable parameter counts), 'uniform' (balance "
                                            "layer counts) or 'type:<regex>' (balance the layers whose class name "
                                            "matches); null: the PipelineModule's, which must agree when given.")

    activation_checkpoint_interval: int = Field(0, ge=0, description="Recompute every this many layers' "
                                                "activations in backward instead of keeping them (0: the "
                                                "PipelineModule's own activation_checkpoint_interval); a value > 0 "
                                                "overrides the module's, as in DeepSpeed.")
    use_reentrant: Optional[bool] = Field(None, description="Which torch.utils.checkpoint variant recomputes the "
                                          "layers: true reentrant, false (or null) non-reentrant, which also "
                                          "works when a part's inputs need no gradient.")

    @field_validator("partition_method")
    @classmethod
    def _method(cls, v: Optional[str]) -> Optional[str]:
        if v is None or v.lower() in ("parameters", "uniform"):
            return v if v is None else v.lower()
        if v.lower().startswith("type:"):
            try:
                re.compile(v[5:], re.IGNORECASE)
            except re.error as exc:
                raise ValueError(f"partition_method {v!r}: the regex after 'type:' does not compile ({exc})") from None
            return v
        raise ValueError(f"expected 'parameters', 'uniform' or 'type:<regex>', got {v!r}")

    @model_validator(mode="after")
    def _fits(self) -> PipelineConfig:
        m = self.micro_batches
        if self.schedule == "interleaved_1f1b":
            if self.stages is not None and self.stages < 2:
                raise ValueError("schedule 'interleaved_1f1b' needs stages >= 2 (one stage has nothing to interleave)")
            if self.virtual_stages is not None and self.virtual_stages < 2:
                raise ValueError("schedule 'interleaved_1f1b' needs virtual_stages >= 2 parts per rank; with 1 it "
                                 "is '1f1b'")
            if m is not None and self.stages is not None and m % self.stages:
                raise ValueError(f"schedule 'interleaved_1f1b' runs micro-batches in rounds of `stages`: "
                                 f"micro_batches ({m}) must be a multiple of stages ({self.stages})")
        return self


class TensorParallelConfig(_Section):
    """`tensor_parallel`: slice each layer's weights across `size` ranks (a plan applied with
    `zero.tp.parallelize`, a model built already sliced, or an unsliced HuggingFace GPT-2 or
    Llama, which `zero.initialize` slices by its plan; see docs/parallelism.md)."""

    size: int = Field(1, ge=1, description="Tensor-parallel ranks T (1: no slicing).")

    @model_validator(mode="before")
    @classmethod
    def _autotp(cls, data: Any) -> Any:
        if isinstance(data, dict) and "autotp_size" in data:
            data = dict(data)
            given = data.pop("autotp_size")
            if "size" in data and data["size"] != given:
                raise ValueError(f"both 'size' ({data['size']}) and DeepSpeed's 'autotp_size' ({given}) are given and "
                                 f"differ; keep 'size'")
            data["size"] = given
        return data


def mesh_sizes(pipeline: PipelineConfig, tensor_parallel: TensorParallelConfig, world_size: int) -> tuple[int, int, int]:
    """(P, D, T) for `world_size` ranks (see [Note: the parallel mesh]); ValueError naming the
    keys when the world does not factor."""
    p, t = pipeline.stages or 1, tensor_parallel.size
    if world_size % (p * t):
        raise ValueError(f"the world of {world_size} ranks does not split into pipeline.stages ({p}) x "
                         f"tensor_parallel.size ({t}) x a data-parallel size: {world_size} is not a multiple of "
                         f"{p * t}")
    return p, world_size // (p * t), t
