"""`deepspeed.runtime.pipe.engine`: zero's pipeline engine (built by initialize for a PipelineModule)."""
from zero.pipe.engine import PipelineEngine  # noqa: F401
