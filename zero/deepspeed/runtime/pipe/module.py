"""`deepspeed.runtime.pipe.module`."""
from zero.deepspeed._missing import missing
from zero.deepspeed.runtime.pipe.topology import PipeDataParallelTopology, PipelineParallelGrid  # noqa: F401
from zero.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec  # noqa: F401


def __getattr__(name: str):
    return missing(__name__, name)
