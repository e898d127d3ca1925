"""Update rules: what each optimizer keeps per element, and how it updates one slot.

[Note: declared state]
An update rule says which state it keeps (`state(group)`: a `StateSpec` per tensor: its name,
dtype, and whether it has one value per element, per 8-bit block of elements, or one per slot), and
updates slots holding exactly that (`update`). The storages allocate a slot's state from the
declaration of its param group (nothing for plain SGD, one momentum for Lion, Adam's two moments in
the run's state format, one momentum per Muon matrix), and everything that reads state reads it by
those names: checkpoints save each per-element state as a global tensor `<name>/<param>` and each
per-slot scalar (a torch optimizer's `step`) as a one-element one, at any world size and stage;
the accessors (`safe_get_full_optimizer_state(p, name)`), offload's host tiles, `offload_states()`
and the memory report go by the same names. A new optimizer is a new rule here, nothing else.

The rules:
- `AdamRule`: zero's Adam/AdamW in any state format (fp32/bf16 moments, 8-bit codes with block
  scales), on the native kernels; element-wise, so offload updates it tile by tile.
- `MuonRule`: torch.optim.Muon's update of a whole matrix (see zero/optim/muon.py).
- `ClientRule`: any element-wise torch optimizer run on the shards (see [Note: other optimizers on
  shards] in zero/optim/choice.py). Its state is learnt from the class itself: one step of it on
  a small probe tensor shows which state it keeps (`probe_state`). The torch optimizer then steps
  on the slots with its state tensors replaced by the storage's own (see [Note: client state in
  the storage]); Lion and Adagrad on host masters run zero's native kernels on the same tensors.
The 1-bit optimizers' rules (zero/onebit/) derive from AdamRule.
"""
from __future__ import annotations

import abc

import torch
import torch.nn as nn

from zero.ops.adam_formats import AdamFormat
from zero.state import StateSpec


class UpdateRule(abc.ABC):
    """What one optimizer keeps (`state`) and how it updates slots (`update`); see [Note: declared state]."""

    name: str = "?"
    elementwise: bool = True  # each element's update depends only on its own values: may run tile by tile

    @abc.abstractmethod
    def state(self, group: dict) -> tuple[StateSpec, ...]:
        """The state kept for each slot of a param group with these hyperparameters."""

    @abc.abstractmethod
    def update(self, optimizer, slots: list, grad_scale: float, host) -> None:
        """Update `slots` (zero.stages.storage.Slot, all of this rule) from their gradients divided by
        `grad_scale` (see [Note: one divisor] in zero/optim/step.py). `host`: offload's HostAdam
        (masters and state in host memory, gradients still to be fetched), or None."""


# -- Adam ----------------------------------------------------------------------------------------------


class AdamRule(UpdateRule):
    """Adam/AdamW in the state format `fmt`, on the native kernels (the torch reference where none
    can be built).

    Args:
        fmt: how the master and moments are stored (zero.ops.adam_formats.AdamFormat).
    """

    name = "Adam"

    def __init__(self, fmt: AdamFormat):
        self.fmt = fmt

    def state(self, group: dict) -> tuple[StateSpec, ...]:
        fmt = self.fmt
        if not fmt.quantized:
            return StateSpec("exp_avg", fmt.state_dtype), StateSpec("exp_avg_sq", fmt.state_dtype)
        return (StateSpec("exp_avg", fmt.state_dtype, scales="exp_avg.scale"),
                StateSpec("exp_avg_sq", fmt.state_dtype, scales="exp_avg_sq.scale"),
                StateSpec("exp_avg.scale", torch.float32, "block"), StateSpec("exp_avg_sq.scale", torch.float32, "block"))

    def update(self, optimizer, slots: list, grad_scale: float, host) -> None:
        groups = optimizer.param_groups
        if host is not None:
            threads = optimizer.offload.num_threads
            host.step(slots, lambda tile, out16: self.apply(optimizer, groups[tile.group], tile, grad_scale, out16,
                                                            threads),
                      optimizer.storage.out16_on_host())
            return
        for slot in slots:
            self.apply(optimizer, groups[slot.group], slot, grad_scale, slot.out16)

    def hyperparameters(self, optimizer, group: dict) -> dict:
        """The kernel's arguments for this step (1-bit Adam freezes the variance here)."""
        return dict(step=optimizer.step_count, lr=float(group["lr"]), betas=tuple(group["betas"]), eps=group["eps"],
                    weight_decay=group["weight_decay"], adamw_mode=group["adamw_mode"],
                    bias_correction=group["bias_correction"])

    def apply(self, optimizer, group: dict, slot, grad_scale: float, out16, num_threads=None) -> None:
        """One Adam step on one slot (or a tile of one), the 16-bit result into `out16`."""
        master = slot.master
        if out16 is not None and out16.dtype == torch.float32:  # fp32 model copy kept apart from the master
            self.apply(optimizer, group, slot, grad_scale, None, num_threads)
            out16.copy_(master)
            return
        if out16 is not None and out16.device != master.device:  # e.g. device master, host shard
            staged = torch.empty_like(out16, device=master.device)
            self.apply(optimizer, group, slot, grad_scale, staged, num_threads)
            out16.copy_(staged)
            return
        kwargs = {**self.hyperparameters(optimizer, group), "grad_scale": grad_scale}
        adam_kernel(self.fmt, master, slot.grad, slot.state, out16, slot.index, num_threads, kwargs)


def adam_kernel(fmt: AdamFormat, master, grad, state: dict, out16, index: int, num_threads, kwargs: dict) -> None:
    """The Adam step on one flat range (zero.ops.adam.adam_step, unchecked: the storage made the
    tensors), the torch reference where no native op can be built (see [Note: native-op fallback]
    in zero/ops/fallback.py)."""
    from zero.ops.adam import AdamArgs, adam_step, torch_adam_step
    from zero.ops.fallback import run_native

    args = AdamArgs(**kwargs, fmt=fmt)
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    tensors = dict(m_scale=state.get("exp_avg.scale"), v_scale=state.get("exp_avg_sq.scale"), out16=out16, index=index)
    op = "fused_adam" if master.device.type == "cuda" else "cpu_adam"
    run_native(op, lambda: adam_step(master, grad, exp_avg, exp_avg_sq, args, checked=False, num_threads=num_threads,
                                     **tensors),
               lambda: torch_adam_step(master, grad, exp_avg, exp_avg_sq, args, **tensors), what="zero's Adam step")


# -- Muon ----------------------------------------------------------------------------------------------


class MuonRule(UpdateRule):
    """torch.optim.Muon's step on whole matrices (zero.optim.muon.update_matrix): one fp32 momentum
    per element. Newton-Schulz runs where the model computes; under offload the momentum stays on
    the host and the orthogonalised update crosses the bus (see [Note: Newton-Schulz under offload]
    in zero/optim/muon.py)."""

    name = "Muon"
    elementwise = False

    def state(self, group: dict) -> tuple[StateSpec, ...]:
        return (StateSpec("momentum_buffer", torch.float32),)

    def update(self, optimizer, slots: list, grad_scale: float, host) -> None:
        from zero.optim.muon import MUON_SETTINGS, update_matrix

        for slot in slots:
            compute = slot.grad.device  # Newton-Schulz runs where the model computes
            grad = host.fetch(slot) if host is not None else slot.grad
            group = optimizer.param_groups[slot.group]
            shape = slot.matrix
            update_matrix(slot.master.view(shape), (grad.float() / grad_scale).view(shape),
                          slot.state["momentum_buffer"].view(shape), ns_device=compute,
                          **{k: group[k] for k in MUON_SETTINGS if k in group})
            if slot.out16 is not None:
                slot.out16.copy_(slot.master)


# -- client optimizers -----------------------------------------------------------------------------------

_PROBE = 3  # elements of the probe tensor: a state of 3 elements is per element, of 1 per slot


def probe_state(cls: type, defaults: dict, hyperparameters: dict) -> tuple[StateSpec, ...]:
    """The state `cls` keeps per parameter, found by one step of it on a small probe tensor with
    these hyperparameters: a tensor as large as the parameter is per element, a one-element one
    (torch's `step`, NAdam's `mu_product`) per slot."""
    probe = nn.Parameter(torch.ones(_PROBE), requires_grad=False)  # as the masters it stands for
    probe.grad = torch.full((_PROBE,), 0.5)
    opt = cls([{**hyperparameters, "params": [probe]}], **defaults)
    opt.step()
    specs = []
    for name, value in sorted(opt.state[probe].items()):
        if not isinstance(value, torch.Tensor):
            continue  # None (SGD's momentum without momentum) or a Python number
        if value.numel() == _PROBE and value.dim() == 1:
            specs.append(StateSpec(name, value.dtype))
        elif value.numel() == 1:
            specs.append(StateSpec(name, value.dtype, "scalar"))
        else:
            raise ValueError(f"{cls.__name__} keeps a state {name!r} of shape {tuple(value.shape)} for a parameter of "
                             f"{_PROBE} elements: zero keeps state per element or one value per parameter, so it "
                             f"cannot run this optimizer on shards")
    return tuple(specs)


# [Note: client state in the storage]
# A client optimizer's state lives in the storage like Adam's: allocated from its declaration,
# sharded, offloaded, checkpointed. torch creates an optimizer's state at its first step (SGD copies
# the first gradient into its momentum, Adagrad fills its sum with initial_accumulator_value), so the
# first step runs torch's own initialisation; then each state tensor torch made is copied into the
# storage's and replaced by it in the optimizer's `state`, and the optimizer updates the storage's
# tensors in place from then on. An engine that loaded a checkpoint (its step count is not 0) hands
# its loaded state to the optimizer before the first step instead. A tensor the optimizer replaced
# rather than updated (a scalar it keeps on another device) is copied back after each step.
class ClientRule(UpdateRule):
    """An element-wise torch optimizer class run on the slots (see [Note: other optimizers on shards]
    in zero/optim/choice.py): it steps on the fp32 master pieces, as parameters sharing their
    storage, with the storage's state (see [Note: client state in the storage]). Built once, from the
    first step's slots.

    Args:
        cls: the torch optimizer class.
        defaults: its constructor's keyword arguments (a torch optimizer's `defaults`).
    """

    elementwise = False

    def __init__(self, cls: type, defaults: dict):
        self.cls, self.defaults = cls, defaults
        self.name = cls.__name__
        self._optimizer = None
        self._params: list[nn.Parameter] = []
        self._slots: list = []
        self._groups: list[int] = []
        self._probed: dict[tuple, tuple[StateSpec, ...]] = {}
        self._native_steps = 0
        self._shared = False  # the optimizer's state is the storage's (after its first step, or a load)

    def hyperparameters(self, group: dict) -> dict:
        """A zero param group's hyperparameters for the client optimizer: without the Adam keys
        every group carries (unless the client optimizer has them too)."""
        from zero.optim.step import ADAM_DEFAULTS

        return {k: v for k, v in group.items() if k != "params" and (k not in ADAM_DEFAULTS or k in self.defaults)}

    def state(self, group: dict) -> tuple[StateSpec, ...]:
        hyper = self.hyperparameters(group)
        key = tuple(sorted((k, repr(v)) for k, v in hyper.items()))
        if key not in self._probed:
            self._probed[key] = probe_state(self.cls, self.defaults, hyper)
        return self._probed[key]

    # -- Lion and Adagrad on host masters: zero's native kernels

    def _native_settings(self, param_groups: list[dict], slots: list) -> list[dict] | None:
        """Lion and Adagrad on host masters run zero's native CPU kernels (zero/ops/cpu_optim.py)
        on the slots' own fp32 state (Lion's `exp_avg`, Adagrad's `sum` and `step`), as DeepSpeed's
        offload runs its CPU Lion and Adagrad: each slot's settings, checked, or None where the class
        itself must run (another class, maximize, a state elsewhere, a value the kernels do not take),
        decided before anything changes."""
        from zero.optim.lion import Lion

        if self.cls not in (Lion, torch.optim.Adagrad):
            return None
        out = []
        for slot in slots:
            h = {**self.defaults, **self.hyperparameters(param_groups[slot.group])}
            state = slot.state.get("exp_avg" if self.cls is Lion else "sum")
            numbers = [h["lr"], h["weight_decay"], *([h["eps"], h["lr_decay"]] if self.cls is not Lion else [])]
            if (h.get("maximize") or h.get("differentiable") or h.get("fused") or slot.master.device.type != "cpu"
                    or state is None or state.dtype != torch.float32 or state.numel() != slot.master.numel()
                    or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in numbers)):
                return None
            out.append(h)
        return out

    def _native_step(self, settings: list[dict], slots: list, grad_scale: float, num_threads: int | None) -> None:
        from zero.ops.cpu_optim import adagrad_step, lion_step

        for h, slot in zip(settings, slots):
            out16 = slot.out16
            target = out16 if out16 is not None and out16.device.type == "cpu" and out16.dtype != torch.float32 \
                else None
            if self.cls is torch.optim.Adagrad:
                counter = slot.state["step"]
                step = int(counter.item()) + 1
                if step == 1:  # torch's initial sum
                    slot.state["sum"].fill_(h["initial_accumulator_value"])
                counter.fill_(step)
                clr = h["lr"] / (1 + (step - 1) * h["lr_decay"])
                adagrad_step(slot.master, slot.grad, slot.state["sum"], clr=clr, eps=h["eps"],
                             weight_decay=h["weight_decay"], grad_scale=grad_scale, out16=target,
                             num_threads=num_threads)
            else:
                lion_step(slot.master, slot.grad, slot.state["exp_avg"], lr=h["lr"], betas=tuple(h["betas"]),
                          weight_decay=h["weight_decay"], grad_scale=grad_scale, out16=target,
                          num_threads=num_threads)
            if out16 is not None and target is None:  # a device parameter: one copy per slot
                out16.copy_(slot.master)
        self._native_steps += 1

    # -- the torch optimizer itself

    def _build(self, optimizer, param_groups: list[dict], slots: list) -> None:
        by_group: dict[int, list] = {}
        for slot in slots:
            p = nn.Parameter(slot.master, requires_grad=False)  # shares the master's storage
            by_group.setdefault(slot.group, []).append(p)
            self._params.append(p)
        self._slots = list(slots)
        self._groups = list(by_group)
        groups = [{**self.hyperparameters(param_groups[gi]), "params": ps} for gi, ps in by_group.items()]
        self._optimizer = self.cls(groups, **self.defaults)  # torch optimizers' defaults are their constructor's
        # keyword arguments
        if optimizer.step_count > 1 or self._native_steps:  # resumed, or after native steps: the state is there
            for p, slot in zip(self._params, self._slots):
                self._optimizer.state[p].update(slot.state)
            self._shared = True

    def _adopt(self) -> None:
        """After a torch step: the storage holds every state tensor the optimizer keeps (see [Note:
        client state in the storage])."""
        for p, slot in zip(self._params, self._slots):
            theirs = self._optimizer.state[p]
            for name, ours in slot.state.items():
                t = theirs.get(name)
                if t is None or t is ours:
                    continue
                ours.copy_(t)
                if t.device == ours.device and t.dtype == ours.dtype and t.shape == ours.shape:
                    theirs[name] = ours
        self._shared = True

    def _restore(self) -> None:
        """Before a torch step: a state tensor the optimizer keeps apart from the storage's (see
        `_adopt`) takes the storage's value (a checkpoint may have been loaded into it). Before the
        first step the optimizer's own initial state stands (Adagrad's initial sum)."""
        if not self._shared:
            return
        for p, slot in zip(self._params, self._slots):
            theirs = self._optimizer.state[p]
            for name, ours in slot.state.items():
                t = theirs.get(name)
                if t is not None and t is not ours:
                    t.copy_(ours)

    @torch.no_grad()
    def update(self, optimizer, slots: list, grad_scale: float, host) -> None:
        """One step of the client optimizer on `slots`; the 16-bit outputs are written from the
        masters. With offload the gradients are fetched to the host first and the native Lion and
        Adagrad use offload's threads."""
        if host is not None:
            slots = [slot.with_grad(host.fetch(slot)) for slot in slots]
        num_threads = optimizer.offload.num_threads
        param_groups = optimizer.param_groups
        settings = self._native_settings(param_groups, slots) if self._optimizer is None else None
        if settings is None and self._native_steps:
            raise ValueError(f"{self.cls.__name__}: a param group now asks for what zero's native host step does not do "
                             f"(maximize, differentiable, fused, or a non-number setting), after steps that kept the "
                             f"state in zero's own tensors; set it before the first step")
        if settings is not None:
            self._native_step(settings, slots, grad_scale, num_threads)
            return
        if self._optimizer is None:
            self._build(optimizer, param_groups, slots)
        for group, gi in zip(self._optimizer.param_groups, self._groups):  # the scheduler's lr, etc.
            group.update(self.hyperparameters(param_groups[gi]))
        for p, slot in zip(self._params, slots):
            p.grad = slot.grad.float() / grad_scale
        self._restore()
        self._optimizer.step()
        self._adopt()
        for p, slot in zip(self._params, slots):
            p.grad = None
            if slot.out16 is not None:
                slot.out16.copy_(slot.master)

