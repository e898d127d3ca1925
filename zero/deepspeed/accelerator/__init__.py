"""`deepspeed.accelerator.get_accelerator()`: the device queries scripts use, for CUDA or the CPU."""
from __future__ import annotations

import torch

from zero.deepspeed._missing import missing


class _Accelerator:
    def __init__(self):
        self.cuda = torch.cuda.is_available()

    def device_name(self, device_index: int | None = None) -> str:
        if not self.cuda:
            return "cpu"
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self.cuda else "cpu"

    def current_device(self) -> int:
        return torch.cuda.current_device() if self.cuda else 0

    def device_count(self) -> int:
        return torch.cuda.device_count() if self.cuda else 1

    def is_available(self) -> bool:
        return True

    def communication_backend_name(self) -> str:
        return "nccl" if self.cuda else "gloo"

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def synchronize(self, device_index=None) -> None:
        if self.cuda:
            torch.cuda.synchronize(device_index)

    def empty_cache(self) -> None:
        if self.cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index=None) -> int:
        return torch.cuda.memory_allocated(device_index) if self.cuda else 0

    def max_memory_allocated(self, device_index=None) -> int:
        return torch.cuda.max_memory_allocated(device_index) if self.cuda else 0

    def reset_peak_memory_stats(self, device_index=None) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device_index)

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self.cuda else True

    def is_fp16_supported(self) -> bool:
        return self.cuda


_ACCELERATOR = _Accelerator()


def get_accelerator() -> _Accelerator:
    return _ACCELERATOR


def __getattr__(name: str):
    return missing(__name__, name)
