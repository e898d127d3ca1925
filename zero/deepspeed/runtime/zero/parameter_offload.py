"""`deepspeed.runtime.zero.parameter_offload`: `DeepSpeedZeRoOffload`, for isinstance checks (see
zero/deepspeed/_kinds.py). DeepSpeed's stage-3 optimizer holds one as `parameter_offload`, the part that
gathers and releases parameters around each module; zero's is its Stage3Runtime (zero/stages/stage3.py),
which zero.initialize builds, reached the same way: `engine.optimizer.parameter_offload`."""
from zero.deepspeed._kinds import kind
from zero.deepspeed._missing import missing
from zero.stages.stage3 import Stage3Runtime

DeepSpeedZeRoOffload = kind(
    "DeepSpeedZeRoOffload", __name__, lambda o: isinstance(o, Stage3Runtime),
    "stage 3's runtime, which zero.initialize builds (engine.optimizer.parameter_offload)")


def __getattr__(name: str):
    return missing(__name__, name)
