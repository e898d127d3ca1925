"""`deepspeed.utils`: logging, the safe_get_*/safe_set_* accessors of a trained parameter's values
(zero/accessors.py) and the stage-3 leaf-module marks (zero/init.py; here also by module name)."""
from __future__ import annotations

# DeepSpeed's package has modules named `logging` and `torch`, which an import of them binds here: this
# file's own names avoid theirs
from logging import INFO, getLogger

from torch import cuda, nn

from zero.accessors import (  # noqa: F401
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
    safe_update_full_grad_vectorized,
)
from zero.data import RepeatingLoader  # noqa: F401
from zero.deepspeed._missing import missing

# DeepSpeed's package binds `tensor_fragment` and `z3_leaf_module` to a class and a function named as two
# of its modules. Those modules are imported first, as there, so that importing them later does not
# rebind the names to the modules.
from zero.deepspeed.utils import tensor_fragment as _tensor_fragment_module  # noqa: F401
from zero.deepspeed.utils import z3_leaf_module as _z3_leaf_module_module  # noqa: F401
from zero.deepspeed.utils import zero_to_fp32  # noqa: F401
from zero.init import (  # noqa: F401
    get_z3_leaf_modules,
    refuse_after_initialize,
    set_z3_leaf_modules,
    unset_z3_leaf_modules,
    z3_leaf_module,
)

tensor_fragment = missing(__name__, "tensor_fragment")  # DeepSpeed's class (a stand-in), not the module
logger = getLogger("zero")


def log_dist(message: str, ranks=None, level: int = INFO) -> None:
    """Log `message` on the given ranks (None or [-1]: every rank)."""
    from zero.deepspeed.comm import get_rank

    if ranks is None or -1 in ranks or get_rank() in ranks:
        logger.log(level, f"[Rank {get_rank()}] {message}")


def see_memory_usage(message: str, force: bool = False) -> None:
    """Log the peak GPU memory allocated so far, on rank 0, when `force` (as DeepSpeed's, which
    logs nothing otherwise)."""
    if force:
        peak = cuda.max_memory_allocated() / 2**30 if cuda.is_available() else 0.0
        log_dist(f"{message} | max allocated {peak:.2f} GB", ranks=[0])


def _mark_leaves(model: nn.Module, modules: list[nn.Module], flag: bool, what: str) -> None:
    """Set or clear the stage-3 leaf mark that zero.init.set_z3_leaf_modules sets, on `modules`."""
    refuse_after_initialize(model, what)
    for module in modules:
        module._zero_unit = flag


def set_z3_leaf_module(model: nn.Module, flag: bool) -> None:
    """Mark (or unmark) the module `model` itself as a stage-3 leaf: one unit, gathered as a whole."""
    _mark_leaves(model, [model], flag, "set_z3_leaf_module")


def set_z3_leaf_modules_by_name(model: nn.Module, module_names: list[str], flag: bool = True,
                                raise_if_not_found: bool = True) -> tuple[list[nn.Module], list[str]]:
    """Mark (or, with `flag=False`, unmark) the submodules of `model` named in `module_names` as stage-3
    leaves, by their names in `model.named_modules()` (`"layers.0.mlp"`). Call before zero.initialize.

    Args:
        model: the model holding the modules.
        module_names: names as `model.named_modules()` gives them.
        flag: True marks, False unmarks.
        raise_if_not_found: raise ValueError, naming them, when some names match no module.

    Returns:
        The modules found, and the names that matched none.
    """
    by_name = dict(model.named_modules())
    found = [by_name[n] for n in module_names if n in by_name]
    absent = [n for n in module_names if n not in by_name]
    if absent and raise_if_not_found:
        raise ValueError(f"set_z3_leaf_modules_by_name: no module named {absent} in {type(model).__name__} "
                         f"(names are those of model.named_modules(), e.g. {next((n for n in by_name if n), '')!r})")
    _mark_leaves(model, found, flag, "set_z3_leaf_modules_by_name")
    return found, absent


def set_z3_leaf_modules_by_suffix(model: nn.Module, module_name_suffixes: list[str], flag: bool = True,
                                  raise_if_not_found: bool = True) -> tuple[list[nn.Module], list[str]]:
    """As `set_z3_leaf_modules_by_name`, for every submodule whose name in `model.named_modules()` ends
    with one of `module_name_suffixes` (`"mlp.experts"`).

    Returns:
        The modules found (each once), and the suffixes that matched none.
    """
    named = list(model.named_modules())
    found = list({id(m): m for s in module_name_suffixes for n, m in named if n.endswith(s)}.values())
    absent = [s for s in module_name_suffixes if not any(n.endswith(s) for n, _ in named)]
    if absent and raise_if_not_found:
        raise ValueError(f"set_z3_leaf_modules_by_suffix: no module name ends with {absent} in {type(model).__name__}")
    _mark_leaves(model, found, flag, "set_z3_leaf_modules_by_suffix")
    return found, absent


def __getattr__(name: str):
    return missing("deepspeed.utils", name)
