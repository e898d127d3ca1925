"""`deepspeed.pipe`: the pipeline API on zero.pipe (see docs/parallelism.md)."""
from zero.pipe import LayerSpec, PipelineModule, TiedLayerSpec  # noqa: F401

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
