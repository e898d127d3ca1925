"""How much memory each ZeRO stage and offload option needs per rank, before a run starts.

    zero.estimate_memory(model_or_param_count, world_size=8)          # every stage and offload option
    zero.estimate_memory(7e9, 8, master_dtype="bf16", state_dtype="int8")   # in one state format
    zero.estimate_memory(7e9, 8, state_formats=True)                  # ... and in each common one
    python -m zero.estimate --params 7e9 --gpus 8 --nodes 2            # the same, as a table
    python -m zero.estimate --params 7e9 --gpus 8 --state-formats      # one line per state format
    python -m zero.estimate --model path/to/hf/config.json --gpus 8

[Note: the estimator's numbers]
The estimator reads the same policies the engine builds from a config (zero/stages/policies.py:
dtypes, the optimizer's state format, bucket sizes, stage-3 thresholds, offload tiles), so a setting
means the same thing in both. With Psi trainable elements on N ranks, p bytes per training-dtype
element, g per gradient-shard element (fp32 when micro-batches are accumulated or training is fp32,
else the communication dtype; a bf16 master keeps it in bf16 even when accumulating), and the
optimizer's state format (zero/ops/adam_formats.py; docs/config.md, "State formats"):

    M  bytes per master element: 4 (fp32) or 2 (bf16); 0 where the master is the parameter itself
       (its dtype is the training dtype and the optimizer is not offloaded: fp32 training, or bf16
       training with `bf16_master_weights_and_grads`; also stage 3's `offload_param` keeps it apart)
    S  bytes per element of Adam's m and v together: 8 (fp32), 4 (bf16), or 2 + 8/256 (8-bit codes:
       one byte each, plus one fp32 scale per block of 256 elements of each moment; the blocks
       start at each bucket slice's or unit shard's start, so a planned model's scales are counted
       per slot, as the engine allocates them). Another optimizer keeps the state its update rule
       declares (see [Note: declared state] in zero/optim/rules.py), read from the same rule the
       engine builds: SGD with momentum 4 (its momentum_buffer; without momentum 0), Lion 4
       (exp_avg), Adagrad 4 (sum) plus its 4-byte step once per slot.

    stage  params           grads      master   Adam m, v
    0      p Psi            g Psi      M Psi    S Psi          (plain data parallelism)
    1      p Psi            g Psi      M Psi/N  S Psi/N
    2      p Psi            g Psi/N    M Psi/N  S Psi/N
    3      p Psi/N + p P    g Psi/N    M Psi/N  S Psi/N        (P: persistent elements, kept whole)

At stage 3 that is, per parameter over all ranks, for bf16 training: 2 + 2 + 4 + 8 = 16 bytes with
an fp32 master and fp32 moments, 8 with a bf16 master and bf16 moments, 12 with one of them bf16,
10.03 with an fp32 master and 8-bit moments, 6.03 with a bf16 master and 8-bit moments. The row's
`fp32_master` (the engine's memory_report() key) holds the master in whatever format it has.

Muon (zero/optim/muon.py) keeps one fp32 momentum for each matrix it updates, S = 4, and its fp32
master is always apart at stage 3 (the matrix is whole on its owner, the model's shards are not):
2 + 2 + 4 + 4 = 12 bytes per Muon parameter in bf16 training; its AdamW parameters count as
above. A rank holds the states of the matrices it owns (whole matrices, balanced by Newton-Schulz
work): for a model the estimate is the most loaded rank's, for a parameter count the mean.
`muon_params` gives what Muon updates; by default a Muon config's model is split as the engine
splits it, and a bare parameter count is all Muon's.

Optimizer offload moves the master and Adam's states to the host and adds the host staging of the
gradient shard and two copy-back tiles; stage 3's `offload_param` moves the parameter shards there
too. These are the kinds `Engine.memory_report()` measures, and on a real run the two agree up to
padding (each bucket or unit is padded to split evenly over N SIMD-aligned slices), in every state
format (tests/test_estimate.py).

With `nvme=True` (ZeRO-Infinity) the offload options keep their states in files: `disk_bytes` is
the master and states (optimizer offload) and the parameter shards beyond `max_in_cpu` elements
(stage 3's `offload_param`), and host memory holds instead `buffer_count` buffers of them
(`nvme_buffers`): one step tile (`sub_group_size`, capped) of the master and states each, with each
tensor from a page boundary, and the largest unit's shard each. The host copy of the gradient
shard stays in host memory.

With a OneBitAdam or ZeroOneAdam config, `compression_errors` (included in `buffers`) is the error
buffers: an fp32 copy of the trainable parameters per rank, plus 1/N of it at stage 0. ZeroOneAdam
adds two more fp32 copies to `buffers` (its momentum accumulator and anchor).

With `zero_hpz_partition_size` = L (ZeRO++ hpZ) stage 3's buffers also hold the secondary shards
from forward to the end of backward: p Psi / L (the units that are not persistent). ZeRO++'s and
MiCS's collectives add their temporaries (zero.estimate.comm.collective_temporaries).

`buffers` is the communication and gathering memory of a step beyond the model states: stages 0-1
one bucket cast to the communication dtype (when it differs); stage 2 the staging buffers of the
buckets being filled or reduced, three when backward produces gradients in about the reverse of the
order the parameters were registered (the usual case; a model that runs its layers in another order
can hold a staging buffer for every bucket at once, up to a full gradient); stage 3 the gathered
parameters (`stage3_max_live_parameters`, at least one unit), one all-gather output and two units'
gradient sends (plus a shard staged onto the device with `offload_param`), sized by the largest unit
(planned for a model, `largest_layer` for a count), and ZeRO++'s temporaries (the gathers in flight).
"""
from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn

from zero.estimate.comm import Gathered, collective_temporaries
from zero.estimate.units import format_bytes, human_count

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
OFFLOADS = ("none", "optimizer", "param", "optimizer+param")
MASTER_DTYPES = ("fp32", "bf16")
STATE_DTYPES = ("fp32", "bf16", "int8")
# (master, moments) compared by `state_formats=True`: bf16 training, and fp16/fp32 training (whose
# master is fp32: a bf16 master needs bf16 training)
STATE_FORMATS = {"bf16": (("fp32", "fp32"), ("bf16", "bf16"), ("fp32", "int8"), ("bf16", "int8")),
                 "other": (("fp32", "fp32"), ("fp32", "bf16"), ("fp32", "int8"))}


def state_format_label(master_dtype: str, state_dtype: str) -> str:
    """"bf16 master + 8-bit moments" and the like."""
    return f"{master_dtype} master + {'8-bit' if state_dtype == 'int8' else state_dtype} moments"


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank for one stage, offload option and state format (see [Note: the estimator's numbers])."""

    stage: int
    offload: str  # "none", "optimizer", "param" or "optimizer+param"
    world_size: int
    params: int
    grads: int
    fp32_master: int  # the master weights in their format (fp32 or bf16), as memory_report() names them
    optimizer_states: int  # the optimizer's declared state: Adam's m and v in their format (8-bit codes' block
    # scales included), or another optimizer's (SGD's momentum, Lion's exp_avg, Adagrad's sum and step)
    host_staging: int  # offload's host gradient copy and copy-back tiles
    buffers: int  # device communication and gathered-parameter buffers, at most
    compression_errors: int  # OneBitAdam's error buffers (device), see zero/onebit/optimizer.py
    device_bytes: int  # model states on the device plus `buffers`
    host_bytes: int  # model states and staging in host memory
    master_dtype: str = "fp32"  # the master weights' format: "fp32" or "bf16"
    state_dtype: str = "fp32"  # Adam's moments' format: "fp32", "bf16" or "int8"
    activations: int = 0  # one forward and backward's peak beyond the parameters (estimate_activations)
    buffers_in_backward: int = 0  # the part of `buffers` alive while backward starts (see the note)
    muon_params: int = 0  # the elements Muon updates (one fp32 momentum each; see the note)
    element_bytes: tuple[int, int] = (2, 2)  # bytes per parameter and per gradient-shard element
    optimizer_state: str = ""  # a non-Adam optimizer's declared state ("SGD: momentum_buffer (fp32)"); "": Adam's
    nvme: bool = False  # the offloaded states go to NVMe (offload_optimizer / offload_param device "nvme")
    disk_bytes: int = 0  # NVMe offload: the states in this rank's swap files
    nvme_buffers: int = 0  # NVMe offload: the host buffers they are read into (in host_bytes)

    @property
    def peak_bytes(self) -> int:
        """The most device memory of a training step: model states on the device, then either the
        activations' peak with the buffers alive beside it or all buffers, whichever is more
        (see [Note: the estimator's numbers]); with no activations given, `device_bytes`."""
        return self.device_bytes - self.buffers + max(self.buffers, self.activations + self.buffers_in_backward)

    @property
    def model_states_total(self) -> int:
        return self.params + self.grads + self.fp32_master + self.optimizer_states

    @property
    def label(self) -> str:
        name = "stage 0 (= DDP)" if self.stage == 0 else f"stage {self.stage}"
        return name if self.offload == "none" else f"{name} + offload {self.offload}" + (" to NVMe" if self.nvme else "")

    @property
    def state_format(self) -> str:
        """"fp32 master + fp32 moments", "bf16 master + 8-bit moments", ... (", Muon" when Muon
        updates some of the parameters); "fp32 master + SGD: momentum_buffer (fp32)" for another
        optimizer."""
        if self.optimizer_state:
            return f"{self.master_dtype} master + {self.optimizer_state}"
        return state_format_label(self.master_dtype, self.state_dtype) + (", Muon" if self.muon_params else "")

    def bytes_per_param(self, psi: int) -> float:
        """Model-state bytes per trainable parameter over all ranks (16 for stage 3 in bf16 with
        fp32 Adam states, 12 for Muon's matrices)."""
        return self.model_states_total * self.world_size / psi


class MemoryTable(list):
    """A list of MemoryEstimate rows that prints as a table (with a state-format column when the rows
    have several)."""

    def __init__(self, rows, psi: int, persistent: int, dtype: str, gpus_per_node: int, largest_unit: int = 0):
        super().__init__(rows)
        self.psi, self.persistent, self.dtype, self.gpus_per_node = psi, persistent, dtype, gpus_per_node
        self.largest_unit = largest_unit

    def row(self, stage: int, offload: str = "none", master_dtype: str | None = None,
            state_dtype: str | None = None) -> MemoryEstimate:
        """The row of `stage` and `offload`: in the given state format, else the table's first (the
        config's, or the one asked for)."""
        for r in self:
            if (r.stage == stage and r.offload == offload and master_dtype in (None, r.master_dtype)
                    and state_dtype in (None, r.state_dtype)):
                return r
        fmt = "" if master_dtype is None and state_dtype is None else \
            f" in master {master_dtype or 'any'}, moments {state_dtype or 'any'}"
        raise KeyError(f"no row for stage {stage} with offload {offload!r}{fmt} in this table")

    @property
    def state_formats(self) -> list[str]:
        """The rows' state formats, in order of first appearance."""
        return list(dict.fromkeys(r.state_format for r in self))

    def __str__(self) -> str:
        n = self[0].world_size if self else 1
        formats = self.state_formats
        several = len(formats) > 1
        head = (f"{self.psi:,} trainable parameters ({human_count(self.psi)}), {self.dtype}, "
                + ("every state format" if several else formats[0] if formats else "") + f", {n} rank(s)"
                + (f", {self.persistent:,} kept whole under stage 3" if self.persistent else ""))
        peaks = any(r.activations for r in self)
        disk = any(r.disk_bytes for r in self)
        cols = ["option", *(["state format"] if several else []), "model states/rank", "B/param (all ranks)",
                "device/rank", *(["peak/rank"] if peaks else []), "host/rank", f"host/node ({self.gpus_per_node} ranks)",
                *(["disk/rank"] if disk else [])]
        lines, last = [], None
        for r in self:
            label = r.label if r.label != last else ""  # with several formats: the option once per group
            last = r.label
            lines.append([label, *([r.state_format] if several else []), format_bytes(r.model_states_total),
                          f"{r.bytes_per_param(self.psi):.1f}", format_bytes(r.device_bytes),
                          *([format_bytes(r.peak_bytes)] if peaks else []),
                          format_bytes(r.host_bytes), format_bytes(r.host_bytes * self.gpus_per_node),
                          *([format_bytes(r.disk_bytes)] if disk else [])])
        text = 2 if several else 1  # left-aligned columns
        widths = [max(len(c), *(len(line[i]) for line in lines)) for i, c in enumerate(cols)]
        out = [head, "  ".join(c.ljust(w) for c, w in zip(cols, widths)), "  ".join("-" * w for w in widths)]
        out += ["  ".join(v.ljust(w) if i < text else v.rjust(w) for i, (v, w) in enumerate(zip(line, widths)))
                for line in lines]
        out.append("device/rank includes the communication and gathering buffers of a step"
                   + (f" (stage 3: largest unit {self.largest_unit:,} elements)" if self.largest_unit else ""))
        muon = self[0].muon_params if self else 0
        p, g = self[0].element_bytes if self else (4, 4)
        if muon and p < 4:  # mixed precision (in fp32, Adam's master is the parameter itself)
            out.append(f"Muon updates {muon:,} of the parameters: an fp32 master and one fp32 momentum each, "
                       f"{p + g + 8} B per parameter over all ranks at stage 3 (Adam's: {p + g + 4 + 8})")
        if peaks:
            out.append(f"peak/rank adds one forward and backward's activations ({format_bytes(self[0].activations)}, "
                       f"zero.estimate_activations) to the model states and the buffers alive beside them")
        if disk:
            out.append("NVMe offload: disk/rank is the offloaded states in this rank's swap files; host/rank keeps "
                       "the buffers they are read into (buffer_count of them) instead of the states")
        if several:
            out.append("state format: how the optimizer stores the master weights and Adam's moments (8-bit: one "
                       "byte each, one fp32 scale per 256 elements); docs/config.md, 'State formats'")
        return "\n".join(out)


def estimate_memory(model_or_param_count: nn.Module | int | float, world_size: int = 1, *,
                    stage: int | None = None, offload: str | None = None, dtype: str | torch.dtype = "bf16",
                    config: dict | str | None = None, gpus_per_node: int | None = None,
                    persistent_params: int | None = None, largest_layer: int | None = None,
                    master_dtype: str | None = None, state_dtype: str | None = None,
                    state_formats: bool = False, activations=None, muon_params=None,
                    nvme: bool | str = False) -> MemoryTable:
    """Per-rank memory of every stage and offload option (or the ones asked for).

    Args:
        model_or_param_count: a model (its trainable parameters are counted, and under stage 3
            its units and persistent parameters are planned as the engine would) or a number of
            trainable parameters.
        world_size: data-parallel ranks.
        stage: only this stage (0-3); None: all.
        offload: only this option ("none", "optimizer", or for stage 3 "param" and "optimizer+param");
            None: all.
        dtype: training dtype, "bf16", "fp16" or "fp32" (or the torch dtype).
        config: a DeepSpeed-style config (dict, JSON path, or an engine's ZeroConfig) for bucket sizes, thresholds,
            gradient accumulation, the communication dtype and the optimizer's state format
            (`bf16.bf16_master_weights_and_grads`, `bf16.bf16_optimizer_states`,
            `optimizer.params.state_dtype`); its stage, offload and training dtype are replaced by
            each row's.
        gpus_per_node: ranks sharing one host, for the host-per-node column (default world_size).
        persistent_params: with a parameter count, the elements stage 3 keeps whole (default 0;
            a model's are planned).
        largest_layer: with a parameter count, the elements of the largest stage-3 unit (the
            largest layer, DeepSpeed's `largest_layer_params`; default the unit size of the
            config, `stage3_module_granularity_threshold`); it sizes stage 3's buffers.
        master_dtype: the master weights' format, "fp32" or "bf16" (bf16 training only), in place
            of the config's `bf16.bf16_master_weights_and_grads`; None: the config's.
        state_dtype: Adam's moments' format, "fp32", "bf16" or "int8", in place of the config's
            `optimizer.params.state_dtype` / `bf16.bf16_optimizer_states`; None: the config's.
        state_formats: also each common state format (STATE_FORMATS: for bf16 training fp32 or bf16
            master with fp32, bf16 or 8-bit moments as listed there), after the one asked for:
            several rows per option, and the table gets a state-format column.
        activations: one forward and backward's activation memory per rank: an ActivationEstimate
            (zero.estimate_activations, which traces the model at a micro-batch and sequence
            length) or bytes. Each row's `peak_bytes` adds it to the model states (see the note),
            and the table gets a peak column.
        muon_params: what Muon updates (one fp32 momentum per element instead of Adam's two
            moments): the parameters themselves, or their element count; None: with a config of
            optimizer type Muon, the model's matrices as the engine splits them (zero.optim.muon.split),
            or every element of a parameter count; else none.
        nvme: the offload options put their states on NVMe (ZeRO-Infinity; "optimizer" or "param":
            only that one's): the optimizer state, and the parameter shards beyond the config's
            `offload_param.max_in_cpu` (the persistent parameters stay in host memory), count in
            `disk_bytes`; host memory keeps `buffer_count` buffers of them (`nvme_buffers`: a step
            tile of the optimizer state each, the largest unit's shard each), with the config's
            `buffer_count`, `sub_group_size` and `max_in_cpu`.

    Returns:
        A MemoryTable (a list of MemoryEstimate) that prints as a table.
    """
    psi, model = _count(model_or_param_count)
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer (ranks, i.e. GPUs), got {world_size!r}")
    if stage is not None and stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    if offload is not None and offload not in OFFLOADS:
        raise ValueError(f"offload must be one of {OFFLOADS}, got {offload!r}")
    if nvme not in (True, False, "optimizer", "param"):
        raise ValueError(f"nvme must be True, False, 'optimizer' or 'param', got {nvme!r}")
    if offload in ("param", "optimizer+param") and stage not in (None, 3):
        raise ValueError(f"offload {offload!r} (offload_param) needs stage 3, not stage {stage}")
    dtype_name = _dtype_name(dtype)
    if master_dtype is not None and master_dtype not in MASTER_DTYPES:
        raise ValueError(f"master_dtype must be one of {MASTER_DTYPES} (or None: the config's), got {master_dtype!r}")
    if master_dtype == "bf16" and dtype_name != "bf16":
        raise ValueError(f"master_dtype 'bf16' needs bf16 training (dtype='bf16'); {dtype_name} training keeps an "
                         f"fp32 master")
    if state_dtype is not None and state_dtype not in STATE_DTYPES:
        raise ValueError(f"state_dtype must be one of {STATE_DTYPES} (or None: the config's), got {state_dtype!r}")
    if gpus_per_node is None:
        gpus_per_node = world_size
    if not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be a positive integer, got {gpus_per_node!r}")
    if persistent_params is not None and (model is not None or persistent_params < 0):
        raise ValueError("persistent_params is for a parameter count (a model's are planned), and must be >= 0")
    if largest_layer is not None and (model is not None or not isinstance(largest_layer, int) or largest_layer < 1):
        raise ValueError("largest_layer is for a parameter count (a model's units are planned), and must be a "
                         f"positive integer, got {largest_layer!r}")
    activation_bytes = getattr(activations, "peak", activations) or 0
    if isinstance(activation_bytes, bool) or not isinstance(activation_bytes, int) or activation_bytes < 0:
        raise TypeError(f"activations must be an ActivationEstimate (zero.estimate_activations) or a byte count, got "
                        f"{activations!r}")
    if isinstance(muon_params, bool) or isinstance(muon_params, int) and not 0 <= muon_params <= psi:
        raise ValueError(f"muon_params must be parameters, or a whole number of elements between 0 and the {psi:,} "
                         f"trainable ones, got {muon_params!r}")
    if muon_params is not None and not isinstance(muon_params, int):
        muon_params = list(muon_params)
    others = STATE_FORMATS["bf16" if dtype_name == "bf16" else "other"] if state_formats else ()
    rows, persistent_seen, largest_seen = [], 0, 0
    for s in (0, 1, 2, 3) if stage is None else (stage,):
        for o in OFFLOADS if offload is None else (offload,):
            if o in ("param", "optimizer+param") and s != 3:
                continue
            formats = [(master_dtype, state_dtype)]  # the one asked for (None: the config's) first
            for m, st in formats + list(others):
                if (m, st) in {(r.master_dtype, r.state_dtype) for r in rows if (r.stage, r.offload) == (s, o)}:
                    continue
                row, persistent, unit = _estimate(psi, model, world_size, s, o, dtype_name, config, persistent_params,
                                                  largest_layer, m, st, activation_bytes, muon_params, nvme,
                                                  gpus_per_node)
                rows.append(row)
                persistent_seen = max(persistent_seen, persistent)
                largest_seen = max(largest_seen, unit if s == 3 else 0)
    return MemoryTable(rows, psi, persistent_seen, dtype_name, gpus_per_node, largest_seen)


def _count(model_or_param_count) -> tuple[int, nn.Module | None]:
    if isinstance(model_or_param_count, nn.Module):
        return sum(_numel(p) for p in model_or_param_count.parameters() if p.requires_grad), model_or_param_count
    if isinstance(model_or_param_count, bool) or not isinstance(model_or_param_count, (int, float)):
        raise TypeError(f"estimate_memory takes a model or a parameter count, got {type(model_or_param_count).__name__}")
    if not math.isfinite(model_or_param_count) or model_or_param_count < 1 or model_or_param_count != int(model_or_param_count):
        raise ValueError(f"the parameter count must be a positive whole number, got {model_or_param_count!r}")
    return int(model_or_param_count), None


def _numel(p: nn.Parameter) -> int:
    """Elements of `p`, also when stage 3 (or zero.Init) holds only its shard."""
    z = getattr(p, "_zero", None)
    return z.numel if z is not None else p.numel()


def _dtype_name(dtype) -> str:
    for name, d in DTYPES.items():
        if dtype == name or dtype == d:
            return name
    raise ValueError(f"dtype must be one of {list(DTYPES)} (or the torch dtype), got {dtype!r}")


def _policies(config, stage: int, offload: str, dtype: str, world_size: int, master_dtype: str | None,
              state_dtype: str | None):
    from zero.config import ConfigWarning, ZeroConfig, load_config
    from zero.config.loading import _read
    from zero.stages.policies import options_from_config

    if isinstance(config, ZeroConfig):  # an engine's config: what was set, in DeepSpeed's spelling
        data = config.model_dump(by_alias=True, exclude_unset=True)
    else:
        data = dict(_read(config)[0]) if config is not None else {}
    data = copy.deepcopy(data)
    zo = dict(data.get("zero_optimization", {}))
    zo["stage"] = stage
    if stage != 3:  # hpZ and quantized collectives are stage 3's: the other rows go without them
        for key in ("zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_nontrainable_weights",
                    "zero_quantized_gradients", "mics_hierarchical_params_gather"):
            zo.pop(key, None)
    for section, on, keys in (("offload_optimizer", offload in ("optimizer", "optimizer+param"), ("buffer_count",)),
                              ("offload_param", offload in ("param", "optimizer+param"),
                               ("buffer_count", "buffer_size", "max_in_cpu"))):
        given = zo.get(section) if isinstance(zo.get(section), dict) else {}  # NVMe's sizes stay (for nvme=True)
        zo[section] = {"device": "cpu" if on else "none", **{k: v for k, v in given.items() if k in keys}}
    data["zero_optimization"] = zo
    # the training dtype is the row's; the bf16 section's state-format keys stay (with another dtype
    # the config's own check says why they cannot apply)
    bf16 = {**(data.pop("bfloat16", None) or {}), **(data.pop("bf16", None) or {})}
    data.pop("fp16", None)
    bf16 = {k: v for k, v in bf16.items() if k in ("bf16_master_weights_and_grads", "bf16_optimizer_states",
                                                   "stochastic_rounding")}
    if master_dtype is not None:
        bf16["bf16_master_weights_and_grads"] = master_dtype == "bf16"
    opt = data.get("optimizer")
    kind = opt.get("type") if isinstance(opt, dict) else None
    if (master_dtype == "bf16" or state_dtype not in (None, "fp32")) and isinstance(kind, str) \
            and kind.lower() not in ("adam", "adamw"):
        raise ValueError(f"the config's optimizer is {kind}: a bf16 master and bf16 or 8-bit moments (master_dtype, "
                         f"state_dtype, state_formats) are state formats of zero's Adam/AdamW")
    given_state = None  # the moments' format, as a client optimizer object would ask for it
    if state_dtype is not None:
        bf16["bf16_optimizer_states"] = False
        if isinstance(kind, str) and kind.lower() in ("adam", "adamw"):
            opt["params"] = {**(opt.get("params") or {}), "state_dtype": state_dtype}
        elif kind is None:
            given_state = state_dtype
    if dtype != "fp32":
        data[dtype] = {"enabled": True}
    state_now = (opt.get("params") or {}).get("state_dtype") if isinstance(opt, dict) else None
    bf16_stored = dtype == "bf16" and (bf16.get("bf16_master_weights_and_grads") or bf16.get("bf16_optimizer_states"))
    if not (bf16_stored or state_now == "bf16" or given_state == "bf16"):
        bf16.pop("stochastic_rounding", None)  # this row stores nothing in bf16: the rounding has no say
    if any(v is not None and v is not False for v in bf16.values()) or dtype == "bf16":
        data["bf16"] = {**bf16, "enabled": dtype == "bf16"}
    # batch sizes matter only through the accumulation count (fp32 gradient shards when > 1): keep it,
    # and drop the batch sizes the estimate's world size could contradict
    total, micro = data.pop("train_batch_size", None), data.get("train_micro_batch_size_per_gpu")
    if "gradient_accumulation_steps" not in data and isinstance(total, int) and isinstance(micro, int) and micro > 0:
        data["gradient_accumulation_steps"] = max(1, total // (micro * world_size))
    data.setdefault("train_micro_batch_size_per_gpu", 1)
    with warnings.catch_warnings():  # a key that has no effect at some row's stage is not news here
        warnings.simplefilter("ignore", ConfigWarning)
        cfg = load_config(data, world_size)
    kind = cfg.optimizer.type if cfg.optimizer is not None and cfg.optimizer.type in ("OneBitAdam", "ZeroOneAdam") \
        else None
    gather = kind == "OneBitAdam" and cfg.optimizer.onebit.compress_param_gather and stage in (1, 2) and world_size > 1
    muon = cfg.optimizer is not None and cfg.optimizer.type == "Muon"
    from zero.optim.choice import client_step

    client = client_step(cfg, None)  # SGD, Lion, Adagrad, ...: the state their rule declares
    declared = (client.name, client.state(dict(client.defaults))) if client is not None else None
    return (*options_from_config(cfg, world_size, num_threads=1, state_dtype=given_state), kind, gather, muon,
            declared, cfg.zero_optimization)


def _estimate(psi: int, model, n: int, stage: int, offload: str, dtype: str, config, persistent_given,
              largest_layer: int | None, master_dtype: str | None = None, state_dtype: str | None = None,
              activations: int = 0, muon_params: int | None = None, nvme: bool | str = False, node: int = 0):
    precision, step, reduce, s3, onebit, compressed_gather, muon_config, declared, zc = _policies(
        config, stage, offload, dtype, n, master_dtype, state_dtype)
    members = None  # ids of the parameters Muon updates, where known
    if muon_params is None and muon_config and model is not None:
        from zero.optim.muon import split

        named = dict(model.named_parameters())
        muon_params = [named[name] for name in split(model.named_parameters())[0]]
    if muon_params is not None and not isinstance(muon_params, int):
        members = {id(q) for q in muon_params}
        muon_params = sum(_numel(q) for q in muon_params)
    muon_params = muon_params if muon_params is not None else (psi if muon_config else 0)
    adam_numel = (lambda q: 0 if id(q) in members else _numel(q)) if members is not None else _numel
    from zero.ops.adam_formats import Q8_BLOCK, q8_blocks

    fmt = precision.adam
    p, g = precision.param.itemsize, precision.grad.itemsize
    r = precision.reduce.itemsize
    offload_opt, offload_param = step.offload.on_host, s3.offload_param
    # a master in the model's dtype, with the optimizer beside the model, is the parameters themselves
    # (OneBitAdam's compressed gather needs them apart)
    apart = not precision.master_is_model or offload_opt or offload_param or compressed_gather
    master = fmt.master_dtype.itemsize if apart else 0
    shard = psi / n if stage >= 1 else psi  # the optimizer's part
    persistent, largest_unit = 0, min(psi, largest_layer or s3.unit_elements)
    if stage == 3:
        if model is not None:
            from zero.stages.planning import plan_units

            units, kept = plan_units(model, s3.persistence_threshold, s3.unit_elements, s3.persistence_budget)
            persistent = sum(_numel(q) for q in kept if q.requires_grad)
            gathers = Gathered.of_units(s3, units, kept, _numel)  # what the gathers carry
            sizes = [sum(_numel(q) for q in ps if q.requires_grad) for _, ps in units] + [persistent]
            largest_unit = max(sizes[:-1], default=0)
            adam_sizes = [sum(adam_numel(q) for q in ps if q.requires_grad) for _, ps in units + [("", kept)]]
            slots = [math.ceil(u / n) for u in adam_sizes if u]  # Adam's slots: each unit's shard, in order
        else:
            persistent = persistent_given or 0
            gathers = Gathered.of_count(s3, psi - persistent, largest_unit, persistent)
    # the shards, and the persistent parameters kept whole on the device (one rank: the shard itself,
    # unless the shards are offloaded)
    params = p * (psi / n + (persistent if n > 1 or offload_param else 0)) if stage == 3 else p * psi
    # Muon's matrices are whole on their owners: a rank holds its owned ones' states (the most loaded
    # rank's, when the model's matrices are known; their mean otherwise)
    muon_shard = muon_params / n if stage >= 1 else muon_params
    if members is not None and stage >= 1 and n > 1:
        from zero.optim.muon import assign_owners, matrix_shape

        matrices = [q for q in model.parameters() if id(q) in members]
        loads = [0] * n
        for q, owner in zip(matrices, assign_owners([matrix_shape(q) for q in matrices], n)):
            loads[owner] += _numel(q)
        muon_shard = max(loads)
    grads = g * ((psi - muon_params) / n + muon_shard if stage >= 2 else psi)
    parts = n if stage >= 1 else 1
    if stage < 3 and model is not None:
        from zero.partition.layout import ShardLayout

        trainable = [q for q in model.parameters() if q.requires_grad]
        layout = ShardLayout([_numel(q) for q in trainable], [int(members is not None and id(q) in members)
                                                              for q in trainable], parts, reduce.bucket_elements)
    if model is None:  # slots of about the largest unit or bucket
        slot = largest_unit / n if stage == 3 else min(psi, reduce.bucket_elements) / parts
        slots = [slot, slot]
    elif stage < 3:  # one slot per bucket slice, laid out as the engine does (Muon's buckets apart)
        slots = [b.slice_numel for b in layout.buckets if b.group == 0]
    adam_shard = (psi - muon_params) / n if stage >= 1 else psi - muon_params
    fp32_master = master * adam_shard + (4 if apart or stage == 3 else 0) * muon_shard
    if declared is not None:  # another optimizer's declared state: per element, and per slot (its `step`)
        per_element = sum(spec.dtype.itemsize for spec in declared[1] if spec.per == "element")
        per_slot = sum(spec.dtype.itemsize for spec in declared[1] if spec.per == "scalar")
        states = per_element * adam_shard + per_slot * (len(slots) if stage >= 1 or model is None else 1)
    else:
        states = 2 * fmt.state_dtype.itemsize * adam_shard + 4 * muon_shard
    if fmt.quantized:  # one fp32 scale per block of each 8-bit moment; blocks start at each slot's start
        blocks = sum(q8_blocks(math.ceil(s)) for s in slots) if model is not None else shard / Q8_BLOCK
        states += 2 * 4 * blocks
    # offload_param: written in place on the host; other optimizers write their 16-bit values whole,
    # with no copy-back tiles
    staged = offload_opt and p < 4 and not offload_param and declared is None
    tiles = _copy_back_tiles(slots, step.offload.tile_elements) * p if staged else 0
    host_staging = g * (adam_shard + muon_shard) + tiles if offload_opt else 0
    if stage < 2:
        buffers = min(psi, reduce.bucket_elements) * r if precision.reduce != precision.grad else 0
        in_backward = 0  # the casts come after backward
    elif stage == 2:  # staging buffers of whole buckets: one filling, two in flight (see the note)
        sizes = sorted((b.numel for b in layout.buckets), reverse=True) if model is not None else (
            [min(psi, reduce.bucket_elements)] * min(3, math.ceil(psi / reduce.bucket_elements)))
        buffers = sum(sizes[:3]) * r
        in_backward = sizes[0] * r  # the bucket the first gradients fill
    else:  # gathered units, one all-gather output, (offload_param) one staged shard, two gradient sends
        gathered = min(psi - persistent, max(s3.max_live_elements, largest_unit))
        buffers = p * gathered + p * largest_unit + (p * largest_unit / n if offload_param else 0) + 2 * r * largest_unit
        in_backward = p * gathered  # the units kept from forward for backward
        if s3.hpz > 1:  # hpZ: a node's share of every unit, kept from forward through backward
            secondary = p * (psi - persistent) / s3.hpz
            buffers += secondary
            in_backward += secondary
        # ZeRO++'s and the two-hop gather's temporaries (see [Note: prefetch and reuse] for the gathers in flight)
        local = node if node < n or s3.hpz < 2 else s3.hpz  # ranks per node (hpZ's group: inside one)
        buffers += collective_temporaries(s3, gathers, n, local, p, r, largest_unit)
    # OneBitAdam (stages 0-2) and ZeroOneAdam (stage 0), several ranks: a worker error per element, a
    # server error per owned element at stage 0; ZeroOneAdam also keeps u and the anchor (8 bytes each)
    errors = 4 * (psi + (psi / n if stage == 0 else 0)) if onebit and n > 1 and stage < 3 else 0
    local_state = 8 * psi if onebit == "ZeroOneAdam" and stage == 0 else 0
    buffers += errors + local_state + (p * shard if compressed_gather else 0)  # the owned slices before the step
    in_backward += errors + local_state
    on_host = (fp32_master + states if offload_opt else 0) + (p * psi / n if offload_param else 0)
    # stage 3 under offload: Muon's owners keep their matrices' 16-bit values in host memory too
    host_copies = p * muon_shard if stage == 3 and (offload_param or offload_opt and n > 1) else 0
    host = on_host + host_staging + host_copies
    device = params + grads + fp32_master + states + buffers - on_host
    disk = nvme_buffers = 0
    nvme_opt, nvme_param = nvme in (True, "optimizer"), nvme in (True, "param")
    if nvme_opt and offload_opt:  # the master and states in files; buffer_count step tiles of them in host memory
        disk += fp32_master + states
        per_element = (fp32_master + states) / max(1, adam_shard + muon_shard)
        tile = min(step.offload.tile_elements, math.ceil(max(slots, default=0)))
        # a buffer holds the tile's master and each of its states, each from a page boundary
        tensors = 1 + (sum(spec.per != "scalar" for spec in declared[1]) if declared is not None else
                       2 + (2 if fmt.quantized else 0))
        nvme_buffers += zc.offload_optimizer.buffer_count * (_aligned(tile * per_element) + 4096 * (tensors - 1))
    if nvme_param and offload_param and stage == 3:  # the shards beyond max_in_cpu in files, read into buffers
        sharded = (psi - persistent) / n  # the persistent parameters stay in host memory
        in_cpu = min(sharded, zc.offload_param.max_in_cpu)
        disk += p * (sharded - in_cpu)
        if in_cpu < sharded:
            nvme_buffers += zc.offload_param.buffer_count * _aligned(p * math.ceil(largest_unit / n))
    host += nvme_buffers - disk
    values = dict(params=params, grads=grads, fp32_master=fp32_master, optimizer_states=states,
                  host_staging=host_staging, buffers=buffers, device_bytes=device, host_bytes=host,
                  compression_errors=errors, buffers_in_backward=in_backward, activations=activations,
                  disk_bytes=disk, nvme_buffers=nvme_buffers)
    optimizer_state = "" if declared is None else f"{declared[0]}: " + (", ".join(
        f"{spec.name} ({'fp32' if spec.dtype == torch.float32 else str(spec.dtype).replace('torch.', '')}"
        f"{'' if spec.per == 'element' else ', one per slot'})" for spec in declared[1]) or "no state")
    row = MemoryEstimate(stage=stage, offload=offload, world_size=n, **{k: int(round(v)) for k, v in values.items()},
                         master_dtype=fmt.master, state_dtype=fmt.state, muon_params=muon_params, element_bytes=(p, g),
                         optimizer_state=optimizer_state,
                         nvme=(nvme_opt and offload_opt) or (nvme_param and offload_param and stage == 3))
    return row, persistent, largest_unit


def _aligned(nbytes: float) -> int:
    """`nbytes` rounded up to whole 4 KiB pages (NVMe offload's aligned buffers)."""
    return -(-math.ceil(nbytes) // 4096) * 4096


def _copy_back_tiles(slots: list[float], tile: int) -> float:
    """Elements of offload's two alternating copy-back tiles (zero/offload/host.py: each slot is updated
    tile by tile, the tiles taking turns, each grown to the largest piece it ever holds)."""
    ring, k = [0.0, 0.0], 0
    for n in slots:
        lo = 0
        while lo < n:
            ring[k % 2] = max(ring[k % 2], min(tile, n - lo))
            lo += tile
            k += 1
    return sum(ring)


from zero.estimate.activations import ActivationEstimate, estimate_activations  # noqa: E402

__all__ = ["ActivationEstimate", "MemoryEstimate", "MemoryTable", "STATE_FORMATS", "estimate_activations",
           "estimate_memory", "format_bytes", "state_format_label"]
