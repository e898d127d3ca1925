"""Stage-3 tools for users: build a model already sharded, and reach a sharded parameter's value.

    with zero.Init(config=ds_config):            # every parameter is sharded as its module is built
        model = MyModel()
    with zero.GatheredParameters(model.head.weight, modifier_rank=0):
        model.head.weight.zero_()                # rank 0's change becomes every rank's new shard
    zero.register_external_parameter(module, param)   # module's forward uses a param it doesn't own
    zero.set_z3_leaf_modules(model, [MoEBlock])  # gather these modules as one unit each

See [Note: parameter shards] in zero/partition/shards.py for what a sharded parameter is.
"""
from __future__ import annotations

import contextlib
import itertools
import types
from collections.abc import Sequence

import torch
import torch.nn as nn

from zero.parallel.comm import Comm
from zero.parallel.sliced import local_tensor
from zero.parallel.tags import Tag
from zero.partition.shards import ShardedParam, ZeroParamStatus, gather_param, mark_ds, shard_numel, take_shard


def _all_subclasses(cls: type) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        out.add(sub)
        out |= _all_subclasses(sub)
    return out


_OPEN_INITS: list[Init] = []  # the Init contexts entered and not yet left, outermost first


def _refuse_unsupported_init_arguments(kwargs: dict) -> None:
    """DeepSpeed's Init arguments zero has no counterpart for: refused unless left at their default."""
    defaults = {"tensor_overrides": (None,), "zero_quantized_weights": (False, True),
                "zero_quantized_nontrainable_weights": (False, True), "mpu": (None,), "zero_param_parallel_group": (None,),
                "sequence_data_parallel_group": (None,), "param_swapper": (None,)}
    for key, value in kwargs.items():
        if key not in defaults:
            raise TypeError(f"zero.Init got an unexpected keyword argument {key!r}")
        # tensor overrides: see ABSENT_NAMES; quantized weights: Init's shards are exact either way, and
        # the engine's all-gathers follow zero_optimization.zero_quantized_weights (ZeRO++ qwZ)
        if key == "tensor_overrides" or any(value is d or value == d for d in defaults[key]):
            continue
        raise ValueError(f"zero.Init({key}={value!r}) is not supported: zero shards every parameter over the "
                         f"data-parallel ranks of the world (no mpu, custom groups or NVMe swap); "
                         f"leave {key} unset")


class Init(contextlib.ContextDecorator):
    """Context manager (or decorator of a function that builds a model): modules built inside it
    have their parameters sharded as they are made.

    After each module's `__init__` returns (the outermost one, so a subclass's own
    initialisation still sees full tensors), each of its parameters is broadcast from rank 0 and
    replaced by this rank's shard. Only the parameters of the module being built are ever full,
    so a model larger than one rank's memory can be constructed. Code that changes parameters
    after construction (custom initialisation loops) must use `GatheredParameters(...,
    modifier_rank=0)`, as with DeepSpeed.

    Contexts nest, as DeepSpeed's: only the outermost one shards (an inner `zero.Init()` in a
    model's own code changes nothing), and `zero.initialize` may be called inside one.

    Args:
        module: an existing model to shard now (every parameter not yet sharded), as DeepSpeed's
            `Init(module=model)`; the context is then not needed.
        data_parallel_group: None or the world: zero shards over all ranks.
        config: the DeepSpeed-style config (dict or path) the engine will use; read for nothing
            but accepted for DeepSpeed compatibility. Stage is not checked here.
        remote_device: "cpu" keeps the shards in CPU memory until `initialize`; None (or
            "device") keeps them where the parameter was created.
        enabled: False makes the context do nothing (DeepSpeed's switch).
        dtype: cast shards to this dtype (default: keep the created dtype, usually fp32, which
            `initialize` uses as the exact fp32 master).

    Attributes:
        peak_full_elements: the most elements of not-yet-sharded parameters alive at once
            during construction (the largest module's own parameters, at most).
    """

    def __init__(self, module: nn.Module | None = None, data_parallel_group=None, mem_efficient_linear: bool = True,
                 remote_device: str | None = None, pin_memory: bool = False, config_dict_or_path=None, config=None,
                 enabled: bool = True, dtype: torch.dtype | None = None, mpu=None, **deepspeed_only):
        # DeepSpeed's argument order; mem_efficient_linear concerns DeepSpeed's own Linear
        _refuse_unsupported_init_arguments({"mpu": mpu, **deepspeed_only})
        if data_parallel_group is not None and (not torch.distributed.is_initialized()
                                                or data_parallel_group is not torch.distributed.group.WORLD):
            raise ValueError("zero.Init(data_parallel_group=...): zero shards over every rank of the world; leave "
                             "data_parallel_group unset")
        if module is not None and not isinstance(module, nn.Module):
            raise TypeError(f"zero.Init(module=...) takes an nn.Module, got {type(module).__name__}")
        if remote_device not in (None, "cpu", "device", "cuda"):
            raise ValueError(f"zero.Init: remote_device must be None, 'cpu' or 'device', got {remote_device!r} "
                             f"('nvme' is not supported)")
        self.enabled = enabled
        self.remote_device = remote_device
        self.pin_memory = pin_memory
        self.dtype = dtype
        self.peak_full_elements = 0
        self._full: dict[int, int] = {}
        self._patched: dict[type, object] = {}
        self._hook = None
        self._outermost = False
        if module is not None and enabled:  # DeepSpeed's Init(module=model): shard an existing model now
            self.comm = Comm()
            for m in module.modules():
                self._shard_own(m)

    def __enter__(self) -> Init:
        self._outermost = self.enabled and not _OPEN_INITS
        if self.enabled:
            _OPEN_INITS.append(self)
        if not self._outermost:  # disabled, or nested in another Init, which shards
            return self
        self.comm = Comm()
        for cls in _all_subclasses(nn.Module) | {nn.Module}:
            if "__init__" in cls.__dict__:
                self._wrap(cls)
        self._prev_init_subclass = nn.Module.__dict__.get("__init_subclass__")
        ctx = self

        def init_subclass(cls, **kw):  # classes defined inside the context are wrapped too
            super(nn.Module, cls).__init_subclass__(**kw)
            if "__init__" in cls.__dict__:
                ctx._wrap(cls)

        nn.Module.__init_subclass__ = classmethod(init_subclass)
        self._hook = torch.nn.modules.module.register_module_parameter_registration_hook(self._on_register)
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            _OPEN_INITS.remove(self)
        if not self._outermost:
            return
        self._outermost = False
        self._hook.remove()
        for cls, original in self._patched.items():
            cls.__init__ = original
        self._patched.clear()
        if self._prev_init_subclass is None:
            del nn.Module.__init_subclass__
        else:
            nn.Module.__init_subclass__ = self._prev_init_subclass

    def _on_register(self, module, name, param):
        if param is not None and getattr(param, "_zero", None) is None:
            self._full[id(param)] = param.numel()
            self.peak_full_elements = max(self.peak_full_elements, sum(self._full.values()))

    def _wrap(self, cls: type) -> None:
        if cls in self._patched:
            return
        original = cls.__init__
        ctx = self

        def __init__(module, *args, **kwargs):
            original(module, *args, **kwargs)
            if type(module).__init__ is __init__:  # the most-derived __init__ has finished
                ctx._shard_own(module)

        __init__.__wrapped__ = original
        self._patched[cls] = original
        cls.__init__ = __init__

    @torch.no_grad()
    def _shard_own(self, module: nn.Module) -> None:
        for p in module.parameters(recurse=False):
            if getattr(p, "_zero", None) is not None:
                continue
            self.comm.broadcast(p.data, src=0)  # every rank starts from rank 0's values
            shard = take_shard(p.data, self.comm.rank, self.comm.world_size)
            dtype = self.dtype or shard.dtype
            if self.remote_device == "cpu":  # cast while copying into the host tensor that is kept, pinned
                host = torch.empty(shard.shape, dtype=dtype, pin_memory=self.pin_memory and torch.cuda.is_available())
                shard = host.copy_(shard)  # pinned directly: no second copy (see [Note: page-locked host memory])
            else:
                shard = shard.to(dtype)
            p._zero = ShardedParam(p.shape, p.numel(), shard_numel(p.numel(), self.comm.world_size), local=shard)
            p.data = shard[:0]
            mark_ds(p, p._zero, shard)
            p._zero_version = p._version  # a later in-place change (lost on the empty .data) is refused at initialize
            self._full.pop(id(p), None)


class GatheredParameters:
    """Context manager: the full value of sharded parameters, for reading or changing them.

    Inside, each listed parameter has its full value on every rank. With `modifier_rank`, that
    rank's values when the context exits become the new value everywhere (the shards, and the
    fp32 master when an engine owns the parameter). Parameters that are not sharded (stages
    0-2, or no engine) are left alone. Every rank must enter the context with the same list.

    Args:
        params: a parameter or an iterable of parameters.
        modifier_rank: the data-parallel rank whose changes are kept (with hybrid sharding, a rank
            of any replica: its values reach every replica); None for read-only use.
        fwd_module: accepted for DeepSpeed compatibility; unused.
        enabled: False makes the context do nothing.
    """

    def __init__(self, params, modifier_rank: int | None = None, fwd_module=None, enabled: bool = True):
        if isinstance(params, torch.Tensor):
            params = [params]
        unique = {id(p): p for p in params if getattr(p, "_zero", None) is not None}
        self.params: list[nn.Parameter] = list(unique.values()) if enabled else []
        self.modifier_rank = modifier_rank
        self._gathered: list[nn.Parameter] = []

    def __enter__(self) -> GatheredParameters:
        if not self.params:
            return self
        self.comm = self.params[0]._zero.comm()  # the group the parameters are sharded over
        unit = self.params[0]._zero.unit
        # hybrid sharding: the ranks holding the same shards; modifier_rank is a data-parallel rank
        # (DeepSpeed's meaning), and its values reach every replica
        self.replicate = unit.placement.replicate if unit is not None else None
        # every rank must enter with the same parameters (see [Note: rank-agreement tags])
        for comm in (self.comm, self.replicate) if self.replicate is not None else (self.comm,):
            comm.agree(Tag.GATHERED_PARAMETERS, len(self.params), sum(p._zero.numel for p in self.params),
                       "GatheredParameters")
        with torch.no_grad():
            for unit in dict.fromkeys(p._zero.unit for p in self.params if p._zero.unit is not None):
                # Muon's matrices updated since their last gather (see [Note: owned parameters in units]
                # in zero/stages/owned.py)
                unit.freshen()
            for p in self.params:
                info: ShardedParam = p._zero
                if local_tensor(p).numel() == info.numel and info.numel > 0:  # its unit is gathered right now
                    if info.unit is not None and info.unit.quantized:
                        # ZeRO++ qwZ gathered decoded int8 values: the exact ones, to read and before
                        # they can be written back into the masters
                        local_tensor(p).copy_(gather_param(info.shard(), info.numel, self.comm).view(info.shape))
                    continue  # (or it is persistent)
                local_tensor(p).data = gather_param(info.shard(), info.numel, self.comm).view(info.shape)
                p.ds_status = ZeroParamStatus.AVAILABLE
                self._gathered.append(p)
        return self

    def __exit__(self, *exc) -> None:
        if not self.params:
            return
        with torch.no_grad():
            if self.modifier_rank is not None and exc[0] is None:
                for p in self.params:
                    self._write_back(p)
            for p in self._gathered:
                local_tensor(p).data = p._zero.shard()[:0]
                p.ds_status = ZeroParamStatus.NOT_AVAILABLE
            for p in self.params:  # what was changed inside has been written back (or was read-only)
                p._zero_version = p._version
        self._gathered.clear()

    def _write_back(self, p: nn.Parameter) -> None:
        info: ShardedParam = p._zero
        local = local_tensor(p).data  # a tensor slice's own piece (see [Note: sliced parameters])
        full = local.contiguous()
        if self.replicate is None:
            self.comm.broadcast(full, src=self.modifier_rank)
        else:  # data rank d is rank d mod S of replica d // S (the shard group's S ranks are the fastest)
            self.comm.broadcast(full, src=self.modifier_rank % self.comm.world_size)
            self.replicate.broadcast(full, src=self.modifier_rank // self.comm.world_size)
        if full.data_ptr() != local.data_ptr():
            local.copy_(full)
        if info.unit is not None:  # the shard, and the fp32 master with it
            info.unit.load_param(p, full.view(info.shape))
        else:
            info.shard().copy_(take_shard(full, self.comm.rank, self.comm.world_size))


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Declare that `module`'s forward uses `parameter`, which belongs to another module.

    Stage 3 then gathers the parameter's unit around `module`'s forward and backward too. Call it
    before `zero.initialize` (for example in the module's `__init__`), as with DeepSpeed. It is
    recorded where DeepSpeed records it: `module._external_params` ({id: parameter}), listed by
    `module.ds_external_parameters()`, with `parameter.is_external_param` set.
    """
    if not isinstance(parameter, nn.Parameter):
        raise RuntimeError(f"register_external_parameter expects an nn.Parameter, got {type(parameter).__name__}")
    _external_params(module)[id(parameter)] = parameter
    parameter.is_external_param = True


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Undo `register_external_parameter` (before `zero.initialize`)."""
    if not isinstance(parameter, nn.Parameter):
        raise RuntimeError(f"unregister_external_parameter expects an nn.Parameter, got {type(parameter).__name__}")
    external = module.__dict__.get("_external_params", {})
    if id(parameter) not in external:
        raise RuntimeError(f"unregister_external_parameter: the parameter of shape {tuple(parameter.shape)} is not a "
                           f"registered external parameter of this {type(module).__name__}")
    del external[id(parameter)]


def external_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters registered as used by `module` but owned elsewhere."""
    return list(module.__dict__.get("_external_params", {}).values())


def _external_params(module: nn.Module) -> dict[int, nn.Parameter]:
    if "_external_params" not in module.__dict__:
        module.__dict__["_external_params"] = {}
        module.ds_external_parameters = types.MethodType(_ds_external_parameters, module)
        module.all_parameters = types.MethodType(_all_parameters, module)
    return module.__dict__["_external_params"]


def _ds_external_parameters(module: nn.Module):
    return module.__dict__["_external_params"].items()


def _all_parameters(module: nn.Module):
    return itertools.chain(module.named_parameters(recurse=False), _ds_external_parameters(module))


def _leaf_matches(model: nn.Module, leaf_module_classes: Sequence[type | str], what: str,
                  raise_if_not_found: bool) -> list[nn.Module]:
    """The submodules whose class is one of `leaf_module_classes`: classes, or class names (plain
    or fully qualified, `module.Class`), as DeepSpeed takes them."""
    kinds = list(leaf_module_classes)
    bad = [k for k in kinds if not isinstance(k, (type, str))]
    if bad:
        raise TypeError(f"{what}: leaf_module_classes holds {bad[0]!r}; expected module classes or class names")
    classes = tuple(k for k in kinds if isinstance(k, type))
    names = {k for k in kinds if isinstance(k, str)}

    def matches(m: nn.Module) -> bool:
        cls = type(m)
        return isinstance(m, classes) or cls.__name__ in names or f"{cls.__module__}.{cls.__qualname__}" in names

    found = [m for m in model.modules() if matches(m)]
    if not found and raise_if_not_found:
        raise ValueError(f"{what}: no module of the classes {kinds} in the model (pass raise_if_not_found=False to "
                         f"allow that)")
    return found


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes: Sequence[type | str],
                        raise_if_not_found: bool = True) -> list[nn.Module]:
    """Make every submodule of the given classes (or class names) one stage-3 unit, gathered as a whole.

    Use it for blocks whose parameters are used together or out of order (mixture-of-experts
    layers, say), and to choose unit boundaries by hand. Call before `zero.initialize`. As
    DeepSpeed's, a ValueError when no module matches, unless `raise_if_not_found=False`.

    Returns:
        The modules that were marked.
    """
    refuse_after_initialize(model, "set_z3_leaf_modules")
    marked = _leaf_matches(model, leaf_module_classes, "set_z3_leaf_modules", raise_if_not_found)
    for m in marked:
        m._zero_unit = True
    return marked


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes: Sequence[type | str],
                          raise_if_not_found: bool = True) -> list[nn.Module]:
    """Undo `set_z3_leaf_modules` for these classes (before `zero.initialize`).

    Returns:
        The modules of those classes (now unmarked).
    """
    refuse_after_initialize(model, "unset_z3_leaf_modules")
    marked = _leaf_matches(model, leaf_module_classes, "unset_z3_leaf_modules", raise_if_not_found)
    for m in marked:
        m._zero_unit = False
    return marked


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The submodules of `model` (itself included) marked as stage-3 leaves."""
    return [m for m in model.modules() if getattr(m, "_zero_unit", False)]


def z3_leaf_module(model: nn.Module) -> bool:
    """Whether `model` is marked as a stage-3 leaf."""
    return bool(getattr(model, "_zero_unit", False))


def refuse_after_initialize(model: nn.Module, what: str) -> None:
    """Leaf marks decide the units when zero.initialize builds them: later they would change nothing."""
    from zero.owners import OWNERS as _OWNERS

    if any(p in _OWNERS for p in model.parameters()):
        raise RuntimeError(f"{what}: this model is already wrapped by zero.initialize, which formed its stage-3 units; "
                           f"mark leaf modules before zero.initialize")
