"""`deepspeed.runtime.zero.offload_config`."""
import enum

from zero.deepspeed._missing import missing


class OffloadDeviceEnum(str, enum.Enum):
    """Where offloaded state lives: zero implements "none" and "cpu" ("nvme" is refused by the config)."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


def __getattr__(name: str):
    return missing(__name__, name)
