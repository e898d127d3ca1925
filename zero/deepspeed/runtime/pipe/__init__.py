"""`deepspeed.runtime.pipe`: the pipeline API on zero.pipe (see docs/parallelism.md), and DeepSpeed's
topology (topology.py) and schedule descriptions (schedule.py)."""
from zero.deepspeed._missing import missing
from zero.deepspeed.runtime.pipe.topology import ProcessTopology  # noqa: F401
from zero.pipe import LayerSpec, PipelineModule, TiedLayerSpec  # noqa: F401


def __getattr__(name: str):
    return missing(__name__, name)
