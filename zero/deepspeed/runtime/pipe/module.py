"""`deepspeed.runtime.pipe.module`."""
from zero.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec  # noqa: F401
