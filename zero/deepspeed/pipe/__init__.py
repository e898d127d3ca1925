"""`deepspeed.pipe`: the pipeline API on zero.pipe (see docs/parallelism.md)."""
from zero.deepspeed._missing import missing
from zero.pipe import LayerSpec, PipelineModule, TiedLayerSpec  # noqa: F401

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]


def __getattr__(name: str):
    return missing(__name__, name)
