"""`deepspeed.accelerator.get_accelerator()`: the device queries scripts use, for CUDA or the CPU."""
from __future__ import annotations

import os

import torch

from zero.deepspeed._missing import missing


class _Accelerator:
    def __init__(self):
        self.cuda = torch.cuda.is_available()
        self._name = "cuda" if self.cuda else "cpu"  # DeepSpeed's accelerators' names, which tests read
        self._communication_backend_name = "nccl" if self.cuda else "gloo"

    def device_name(self, device_index: int | None = None) -> str:
        if not self.cuda:
            return "cpu"
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self.cuda else "cpu"

    def current_device(self) -> int:
        return torch.cuda.current_device() if self.cuda else 0

    def device_count(self) -> int:
        """GPUs, or on the CPU the processes of this node (LOCAL_SIZE, as DeepSpeed's CPU
        accelerator reads it, else torchrun's LOCAL_WORLD_SIZE, else 1)."""
        if self.cuda:
            return torch.cuda.device_count()
        return int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or 1)

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def set_device(self, device_index: int) -> None:
        if self.cuda:
            torch.cuda.set_device(device_index)

    def is_synchronized_device(self) -> bool:
        """True where kernels finish before the call returns (the CPU)."""
        return not self.cuda

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == ("cuda" if self.cuda else "cpu")

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self.cuda else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if self.cuda else True

    def memory_reserved(self, device_index=None) -> int:
        return torch.cuda.memory_reserved(device_index) if self.cuda else 0

    def max_memory_reserved(self, device_index=None) -> int:
        return torch.cuda.max_memory_reserved(device_index) if self.cuda else 0

    def total_memory(self, device_index=None) -> int:
        if self.cuda:
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index=None) -> int:
        if self.cuda:
            return torch.cuda.mem_get_info(device_index)[0]
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    def memory_stats(self, device_index=None) -> dict:
        return torch.cuda.memory_stats(device_index) if self.cuda else {}

    def random(self):
        return torch.random

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def default_generator(self, device_index: int):
        return torch.cuda.default_generators[device_index] if self.cuda else torch.default_generator

    def get_rng_state(self, device_index=None) -> torch.Tensor:
        return torch.cuda.get_rng_state(device_index or "cuda") if self.cuda else torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index=None) -> None:
        if self.cuda:
            torch.cuda.set_rng_state(new_state, device_index or "cuda")
        else:
            torch.set_rng_state(new_state)

    def range_push(self, msg: str) -> None:
        if self.cuda:
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        if self.cuda:
            torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback) -> None:
        return callback()

    def is_triton_supported(self) -> bool:
        return False

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16] + ([torch.float16] if self.cuda else [])

    def export_envs(self) -> list[str]:
        return ["NCCL"] if self.cuda else []

    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"] if self.cuda else []

    def get_op_builder(self, class_name: str):
        from zero.deepspeed.ops import op_builder

        return getattr(op_builder, class_name)

    def create_op_builder(self, class_name: str):
        return self.get_op_builder(class_name)()

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
