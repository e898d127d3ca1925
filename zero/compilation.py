"""Compiling with torch.compile: each repeated block of the model on its own, zero's hooks outside
the graphs (`engine.compile()`, the config's `compile` section).

[Note: compiled blocks]
zero gathers, releases and reduces through module hooks and tensor hooks (stage 3's units, the
gradient buckets' readiness). A graph that contained them would hold collectives and the state of
the last gather; so zero compiles the *forward* of each repeated block (a transformer layer, a
U-Net stage), as torchtitan does, and leaves the module's call around it eager: `block(x)` runs the
block's hooks (stage 3 gathers its unit), then the compiled forward on the gathered parameters,
then the hooks after it (stage 3 releases and sets the backward hooks on the outputs). The backward
of a compiled forward is one autograd node per block; the gradients it produces reach the
parameters' post-accumulate hooks as in eager mode, and stage 3's re-gather runs from the hooks
on the block's outputs before it.

Which modules are blocks: among the classes with two or more instances not inside another repeated
module, the one with the most instances of the same parameter shapes (GPT's `Block`, Llama's
`LlamaDecoderLayer`; not GPT's two embeddings of different sizes), then the most instances, then
the most parameters; or the modules the user names. A block must not contain a module with hooks
of its own (at stage 3, a unit inside a block): such blocks are left eager, with one warning, and
`compile.enabled` makes each block one stage-3 unit before the units are built. Parameters are
inputs of the graphs (dynamo inlines nn.Modules), so one graph serves every block of the same
shapes, and gathered values are read at each call, never baked in. Each block class is compiled
once; a block's `forward` becomes a `CompiledForward` that runs it on that block.

A model compiled whole before `initialize` (`torch.compile(model)`) is unwrapped and its blocks
compiled with the same backend instead, with a warning: a whole-model graph would contain the
hooks.
"""
from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn

log = logging.getLogger("zero")


def _hooked(m: nn.Module) -> bool:
    return bool(m._forward_pre_hooks or m._forward_hooks)


def _params(m: nn.Module) -> int:
    """Parameter elements of `m`, whole also where stage 3 holds only a shard (`ds_numel`)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in m.parameters())


def find_blocks(root: nn.Module) -> list[nn.Module]:
    """The repeated blocks of `root` (see [Note: compiled blocks]); [] when nothing repeats."""
    by_class: dict[type, list[nn.Module]] = defaultdict(list)
    for m in root.modules():
        if m is not root and not isinstance(m, (nn.ModuleList, nn.ModuleDict, nn.Sequential)) and _params(m):
            by_class[type(m)].append(m)
    repeated = {cls: ms for cls, ms in by_class.items() if len(ms) >= 2}
    inside: set[int] = set()  # modules strictly inside an instance of a repeated class
    for ms in repeated.values():
        for m in ms:
            inside |= {id(d) for d in m.modules() if d is not m}
    top = {cls: tops for cls, ms in repeated.items() if len(tops := [m for m in ms if id(m) not in inside]) >= 2}
    if not top:
        return []

    def alike(ms: list[nn.Module]) -> int:  # the most instances with the same parameter shapes
        shapes = [tuple(tuple(getattr(p, "ds_shape", p.shape)) for p in m.parameters()) for m in ms]
        return max(shapes.count(s) for s in shapes)

    # the class repeated most alike (a transformer's layers, not its two embeddings), then most often,
    # then the largest
    cls = max(top, key=lambda c: (alike(top[c]), len(top[c]), sum(_params(m) for m in top[c]), c.__name__))
    return top[cls]


def compiler_of(model: nn.Module):
    """The backend a model compiled whole with torch.compile was given (torch's wrapper of it,
    which keeps its mode and options), found under dynamo's wrappers; None if there is none."""
    backend = getattr(getattr(model, "dynamo_ctx", None), "callback", None)
    for _ in range(8):  # dynamo wraps the backend a few times over
        if backend is None or hasattr(backend, "compiler_name"):
            return backend
        backend = getattr(backend, "_torchdynamo_orig_backend", None)
    return None


def unwrap_compiled(model: nn.Module) -> tuple[nn.Module, Any]:
    """(the module inside a torch.compile wrapper, its backend), or (model, None)."""
    inner = getattr(model, "_orig_mod", None)
    if isinstance(inner, nn.Module) and isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        return inner, compiler_of(model) or "inductor"
    return model, None


def backend_name(backend: Any) -> str:
    return backend if isinstance(backend, str) else getattr(backend, "compiler_name", None) or repr(backend)


def compile_blocks(root: nn.Module, backend: str | Callable = "inductor", compile_kwargs: dict | None = None,
                   modules: Iterable[nn.Module] | None = None) -> list[nn.Module]:
    """Compile the forward of each block of `root` (given, or found by `find_blocks`), leaving
    their hooks outside; returns the blocks compiled.

    Raises:
        ValueError: a given module is not part of `root`, or `compile_kwargs` is not a dict.
    """
    if compile_kwargs is not None and not isinstance(compile_kwargs, dict):
        raise ValueError(f"compile_kwargs must be a dict of torch.compile's keyword arguments, got "
                         f"{type(compile_kwargs).__name__}")
    mine = {id(m) for m in root.modules()}
    blocks = list(modules) if modules is not None else find_blocks(root)
    stray = [type(m).__name__ for m in blocks if id(m) not in mine]
    if stray:
        raise ValueError(f"compile: modules {stray} are not part of the engine's model")
    done, left = [], {}
    for block in blocks:
        hooked = [type(d).__name__ for d in block.modules() if d is not block and _hooked(d)]
        if hooked:
            left.setdefault(type(block).__name__, set()).update(hooked)
            continue
        block.forward = CompiledForward(block, _compiled(type(block), backend, compile_kwargs or {}))  # again: anew
        done.append(block)
    for name, hooked in left.items():
        log.warning("zero: compile leaves the %s blocks eager: they contain modules with hooks (%s), which a graph "
                    "would hold. At stage 3 make each block one unit (zero.set_z3_leaf_modules(model, [%s]), or "
                    "compile.enabled in the config, which does it)", name, ", ".join(sorted(hooked)), name)
    return done


_COMPILED: dict[tuple, Callable] = {}


def _compiled(cls: type, backend, kwargs: dict) -> Callable:
    """`cls.forward` compiled once per class, backend and options, for all its blocks."""
    key = (cls, backend if isinstance(backend, str) else id(backend), repr(sorted(kwargs.items())))
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(cls.forward, backend=backend, **kwargs)
    return _COMPILED[key]


def _eager_forward(block: nn.Module):
    """What an unpickled compiled block's `forward` becomes: its class's, eager."""
    return type(block).forward.__get__(block)


class CompiledForward:
    """A block's compiled forward (its instance attribute `forward`): the class's forward compiled
    once, called on this block. A deep copy of the block (an EMA copy, a reference model) runs
    its own weights through the same compiled function; a pickled block (torch.save(model))
    comes back eager."""

    def __init__(self, block: nn.Module, compiled: Callable):
        self.block, self.compiled = block, compiled

    def __call__(self, *args, **kwargs):
        return self.compiled(self.block, *args, **kwargs)

    def __deepcopy__(self, memo: dict) -> CompiledForward:
        import copy

        return CompiledForward(copy.deepcopy(self.block, memo), self.compiled)

    def __reduce__(self):
        return _eager_forward, (self.block,)


def check_compile_section(section: Any) -> list[tuple[tuple[str, ...], str]]:
    """Problems with the config's `compile` section (DeepSpeed's keys besides zero's `enabled`,
    `backend` and `kwargs`, which only DeepCompile reads, pass)."""
    if not isinstance(section, dict):
        return []
    out = []
    for key, kind, what in (("enabled", bool, "true or false"), ("backend", str, "a torch.compile backend name"),
                            ("kwargs", dict, "an object of torch.compile's keyword arguments")):
        if key in section and not isinstance(section[key], kind):
            out.append((("compile", key), f"expected {what}, got {section[key]!r}"))
    return out
