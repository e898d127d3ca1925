"""What the `deepspeed.module_inject` modules say about the DeepSpeed names zero has no counterpart for."""
from __future__ import annotations

from zero.deepspeed._missing import missing, stand_in

REASON = ("DeepSpeed's module injection (kernel injection, AutoTP's automatic layer replacement, policies, "
          "containers) is not implemented; zero slices a model with torch's tensor-parallel styles: "
          "zero.tp.parallelize(model, zero.tp.mesh(config), plan) with a named plan (gpt, llama, gpt2) or a dict "
          "of module path -> ColwiseParallel/RowwiseParallel, or the config's tensor_parallel.size (DeepSpeed's "
          "autotp_size), with which initialize slices HuggingFace GPT-2 and Llama itself (docs/parallelism.md); "
          "LinearLayer and LinearAllreduce slice single Linear layers")


def unavailable(module: str, name: str) -> type:
    """The stand-in for the DeepSpeed name `module.name` (see [Note: absent names] in
    zero/deepspeed/_missing.py), which says why and what to use."""
    return stand_in(f"{module.removeprefix('zero.')}.{name}", REASON)


def __getattr__(name: str):
    return missing(__name__, name)
