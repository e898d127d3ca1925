"""`deepspeed.runtime.zero.offload_config`."""
import enum


class OffloadDeviceEnum(str, enum.Enum):
    """Where offloaded state lives: zero implements "none" and "cpu" ("nvme" is refused by the config)."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"
