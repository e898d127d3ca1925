"""A trained parameter's full or local values, at any stage: its fp32 master, its Adam state and its
gradient (DeepSpeed's `safe_get_*`/`safe_set_*` accessors; zero.deepspeed.utils re-exports them).

The full-value accessors are collective under ZeRO (every rank of the engine calls them): each rank
puts in the part it holds and one all-reduce gives every rank the whole, as the checkpoint does
(the optimizer storage's `param_chunks`). The local ones read or write this rank's part, flat. The
safe_get_* accessors answer None for a frozen parameter, as DeepSpeed's do; the safe_set_* ones
refuse it. With hybrid sharding (replicas) the gradient accessors, local ones included, are
collective over the replicas: the first of a step sums the gradient shards over them, once (see
[Note: the replicas' sum, once] in zero/stages/placement.py).
"""
from __future__ import annotations

import math

import torch


def _owner(param, frozen_ok: bool = True):
    """The engine's optimizer that trains `param`; None for a frozen parameter (the safe_get_*
    accessors then answer None, as DeepSpeed's do)."""
    from zero.owners import OWNERS as _OWNERS

    if not param.requires_grad:
        if frozen_ok:
            return None
        raise ValueError("this parameter is frozen (requires_grad=False): zero keeps no master, optimizer state or "
                         "gradient for it; change it with zero.GatheredParameters(param, modifier_rank=0)")
    owner, _ = _OWNERS.get(param, (None, False))
    optimizer = owner() if owner is not None else None
    if optimizer is None:
        raise ValueError("this parameter is not trained by a zero engine: its value is the parameter itself")
    return optimizer


def _full(param, kind: str) -> torch.Tensor | None:
    optimizer = _owner(param)
    if optimizer is None:
        return None
    z = getattr(param, "_zero", None)
    shape = z.shape if z is not None else param.shape
    numel = z.numel if z is not None else param.numel()
    full = torch.zeros(numel, dtype=torch.float32)
    for k, offset, view in optimizer.storage.param_chunks(param, saving=True):  # each element from one rank
        if k == kind:
            full[offset : offset + view.numel()] = view.detach().float().cpu()
    optimizer.storage.store.begin_views()
    optimizer.comm.all_reduce(full, "sum")  # host tensor: staged through the GPU under NCCL by Comm
    replicate = optimizer.storage.replicate
    if replicate is not None:  # hybrid sharding: the first replica wrote every element, the others zeros
        replicate.all_reduce(full, "sum")
    return full.view(shape)


def _local(param, kind: str) -> torch.Tensor | None:
    optimizer = _owner(param)
    if optimizer is None:
        return None
    pieces = [v for k, _, v in optimizer.storage.param_chunks(param, saving=False) if k == kind]
    optimizer.storage.store.begin_views()
    return torch.cat([p.detach().reshape(-1) for p in pieces]) if pieces else torch.empty(0)


def _check_state_key(param, key: str) -> None:
    """The keys are the per-element state the parameter's update rule keeps (see [Note: declared
    state] in zero/optim/rules.py), torch's names: Adam's 'exp_avg' and 'exp_avg_sq', a Muon
    matrix's or SGD's 'momentum_buffer', Adagrad's 'sum', ..."""
    optimizer = _owner(param)
    if optimizer is None:  # frozen: the accessor answers None
        return
    keys = optimizer.state_names(param)
    if key not in keys:
        gi = next(i for i, g in enumerate(optimizer.param_groups) if any(q is param for q in g["params"]))
        whose = optimizer.rules[gi].name
        kept = f"keeps {' and '.join(map(repr, keys))}" if keys else "keeps no per-element state"
        raise ValueError(f"optimizer state {key!r}: this parameter is updated by {whose}, which {kept}")


def safe_get_full_fp32_param(param) -> torch.Tensor | None:
    """The full fp32 master value of `param` (collective: every rank calls it)."""
    return _full(param, "master")


def safe_get_full_optimizer_state(param, optim_state_key: str) -> torch.Tensor | None:
    """The full optimizer state `optim_state_key` of `param` (collective): Adam's "exp_avg" or
    "exp_avg_sq", a Muon matrix's "momentum_buffer", or the state a client optimizer keeps under
    torch's name (SGD's "momentum_buffer", Adagrad's "sum", ...)."""
    _check_state_key(param, optim_state_key)
    return _full(param, optim_state_key)


def safe_get_local_fp32_param(param) -> torch.Tensor | None:
    """This rank's part of the fp32 master of `param`, flat (not collective)."""
    return _local(param, "master")


def safe_get_local_optimizer_state(param, optim_state_key: str) -> torch.Tensor | None:
    """This rank's part of `param`'s Adam state `optim_state_key`, flat (not collective)."""
    _check_state_key(param, optim_state_key)
    return _local(param, optim_state_key)


def safe_get_full_grad(param) -> torch.Tensor | None:
    """The full mean gradient of `param` that the coming step applies (before clipping), fp32
    (collective). Call it after the backward of an accumulation boundary, before `step()`."""
    optimizer = _owner(param)
    if optimizer is None:
        return None
    optimizer.storage.sum_replicas()  # hybrid sharding: reduced pieces final on every replica
    offset, piece, reduced = optimizer.storage.grad_piece(param)
    z = getattr(param, "_zero", None)
    shape = z.shape if z is not None else param.shape
    full = torch.zeros(math.prod(shape), dtype=torch.float32)
    full[offset : offset + piece.numel()] = piece.detach().float().cpu()
    optimizer.comm.all_reduce(full, "sum")  # reduced pieces are disjoint; unreduced ones sum as the step would
    if not reduced and optimizer.storage.replicate is not None:  # ... over the replicas too
        optimizer.storage.replicate.all_reduce(full, "sum")
    return full.div_(optimizer.grad_divisor(reduced)).view(shape)


def _reduced_piece(param, frozen_ok: bool) -> tuple:
    optimizer = _owner(param, frozen_ok)
    if optimizer is None:
        return None, None
    optimizer.storage.sum_replicas()  # hybrid sharding: collective over the replicas, once per step
    _, piece, reduced = optimizer.storage.grad_piece(param)
    if not reduced:
        raise ValueError(f"safe_get_local_grad/safe_set_local_grad: at stage {optimizer.storage.stage} gradients are "
                         "reduced inside step(), so before it no rank holds a part of the reduced gradient; use "
                         "stage 2 or 3, or safe_get_full_grad (collective)")
    return optimizer, piece


def safe_get_local_grad(param) -> torch.Tensor | None:
    """This rank's part of `param`'s mean gradient (as safe_get_full_grad, flat, fp32; stages 2, 3)."""
    optimizer, piece = _reduced_piece(param, frozen_ok=True)
    return None if optimizer is None else piece.detach().float() / optimizer.grad_divisor(True)


def safe_set_local_grad(param, value: torch.Tensor) -> None:
    """Replace this rank's part of `param`'s gradient by `value` (shaped as safe_get_local_grad's
    answer); the coming step applies it."""
    optimizer, piece = _reduced_piece(param, frozen_ok=False)
    if not isinstance(value, torch.Tensor) or value.numel() != piece.numel():
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"safe_set_local_grad: this rank holds {piece.numel()} elements of the gradient of a "
                         f"parameter of shape {tuple(getattr(param, 'ds_shape', param.shape))}; got {got}")
    if optimizer.host_adam is not None:  # offload: copies of the old values may be on their way to the host
        optimizer.host_adam.discard()  # the step copies again
    with torch.no_grad():
        piece.copy_(value.detach().reshape(-1).to(piece.device, torch.float32) * optimizer.grad_divisor(True))


def _set_full(param, kind: str, value: torch.Tensor) -> None:
    optimizer = _owner(param, frozen_ok=False)
    flat = value.detach().reshape(-1).float()
    with torch.no_grad():
        for k, offset, view in optimizer.storage.param_chunks(param, saving=False):
            if k == kind:
                view.copy_(flat[offset : offset + view.numel()])
        if kind == "master":  # the training copy follows the master
            for k, offset, view in optimizer.storage.param_chunks(param, saving=False):
                if k == "model":
                    view.copy_(flat[offset : offset + view.numel()])
    optimizer.storage.state_written()  # 8-bit moments: encode what was written
    if kind == "master":
        optimizer.storage.edits_seen([param])
        optimizer.storage.values_set(param)  # collective, as this accessor is


def safe_set_full_fp32_param(param, value: torch.Tensor) -> None:
    """Set `param`'s fp32 master (and its training copy) to the full `value`, given on every rank."""
    _set_full(param, "master", value)


def safe_set_full_optimizer_state(param, value: torch.Tensor, optim_state_key: str) -> None:
    """Set `param`'s Adam state `optim_state_key` to the full `value`, given on every rank."""
    _check_state_key(param, optim_state_key)
    _set_full(param, optim_state_key, value)


def safe_set_full_grad(param, value: torch.Tensor) -> None:
    """Set `param`'s mean gradient that the coming step applies (as safe_get_full_grad's answer)
    to the full `value`, given on every rank (collective in meaning: every rank calls it). Call it
    after the backward of an accumulation boundary, before `step()`."""
    optimizer = _owner(param, frozen_ok=False)
    shape = tuple(getattr(param, "ds_shape", param.shape))
    if not isinstance(value, torch.Tensor) or value.numel() != math.prod(shape):
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"safe_set_full_grad: the parameter has shape {shape}; got {got}")
    optimizer.storage.sum_replicas()  # hybrid sharding: the step must not sum what is set over the replicas
    offset, piece, reduced = optimizer.storage.grad_piece(param)
    flat = value.detach().reshape(-1).float()[offset : offset + piece.numel()]
    # a reduced piece is this rank's part of the sum; unreduced ones (stages 0, 1) are summed by the step
    scale = optimizer.grad_divisor(reduced) / (1 if reduced else optimizer.storage.summed)
    if optimizer.host_adam is not None:  # offload: copies of the old values may be on their way to the host
        optimizer.host_adam.discard()
    with torch.no_grad():
        piece.copy_((flat * scale).to(piece.device, piece.dtype).view_as(piece))


def _set_local(param, kind: str, value: torch.Tensor, what: str) -> None:
    optimizer = _owner(param, frozen_ok=False)
    chunks = optimizer.storage.param_chunks(param, saving=False)
    mine = [(offset, view) for k, offset, view in chunks if k == kind]
    size = sum(view.numel() for _, view in mine)
    if not isinstance(value, torch.Tensor) or value.numel() != size:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{what}: this rank holds {size} elements of this parameter's {kind}; got {got}")
    flat, at = value.detach().reshape(-1).float(), 0
    with torch.no_grad():
        for offset, view in mine:
            view.copy_(flat[at : at + view.numel()].to(view.device).view_as(view))
            if kind == "master":  # the training copy of the same elements follows
                for k, o, model in chunks:
                    if k == "model" and o == offset and model.numel() == view.numel():
                        model.copy_(view.view_as(model))
            at += view.numel()
    optimizer.storage.state_written()  # 8-bit moments: encode what was written


def safe_set_local_fp32_param(param, value: torch.Tensor) -> None:
    """Set this rank's part of a stage-3 parameter's fp32 master (and of its training copy) to
    `value`, flat, shaped as safe_get_local_fp32_param's answer (not collective)."""
    if getattr(param, "_zero", None) is None:
        raise ValueError("safe_set_local_fp32_param: the parameter is not partitioned (ZeRO stage 3 only, as in "
                         "DeepSpeed); use safe_set_full_fp32_param")
    _set_local(param, "master", value, "safe_set_local_fp32_param")


def safe_set_local_optimizer_state(param, value: torch.Tensor, optim_state_key: str) -> None:
    """Set this rank's part of `param`'s Adam state `optim_state_key` to `value`, flat, shaped as
    safe_get_local_optimizer_state's answer (not collective)."""
    _check_state_key(param, optim_state_key)
    _set_local(param, optim_state_key, value, "safe_set_local_optimizer_state")


def safe_update_full_grad_vectorized(param_list, update_func) -> None:
    """For each trainable parameter of `param_list`, replace its mean gradient by
    `update_func(full_gradient, param)` (safe_get_full_grad, then safe_set_full_grad: collective,
    every rank calls it with the same list)."""
    for p in param_list:
        if p.requires_grad:
            safe_set_full_grad(p, update_func(safe_get_full_grad(p), p))
