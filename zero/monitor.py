"""What a user watches while zero trains: a progress bar, and one table at the end.

    monitor = zero.TrainingMonitor(engine, steps=200, tokens_per_step=batch * seq_len * world)
    for x, y in loader:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        monitor.step(loss)              # every rank, after every engine.step()
    print(monitor.report(), end="")     # every rank calls it; rank 0 gets the table

[Note: what the monitor measures]
- Time per step is the mean of a moving window of optimizer steps that never includes the first
  one (which builds the native ops and records stage 3's unit order) nor the second (whose peak
  memory is measured).
- Memory per rank: on CUDA the allocator's `memory_allocated`; on the CPU, which has no allocator
  statistics, the bytes `Engine.memory_report()` measures from the storages the engine holds
  (model states, offload staging, buffers alive now). All ranks' numbers are gathered every
  `memory_every` steps on the control group, so the counts of the data group stay those of
  training.
- The peak of one step, measured and estimated: the second optimizer step (forward, backward and
  step) is measured at the allocator (CUDA: `max_memory_allocated` of that step, for which the
  peak statistics are reset once, the run's peak before it kept for the table; CPU: the bytes the engine
  holds when it starts plus the most torch's CPU allocator adds during it, read from one step of
  the profiler, which that step's time leaves out). The estimate is the model states and buffers
  of zero.estimate_memory plus the activations of zero.estimate_activations, traced with the
  shapes of the first micro-batch the model was given (its forward's inputs; backward starts from
  the output's loss or sum, so a loss computed outside the model adds what it keeps).
- The end table names the optimizer's state format (master weights and Adam's moments: fp32,
  bf16 or 8-bit; see docs/config.md, "State formats") and sets this run's measured model-state
  bytes beside the estimator's number for the same run in that format (zero.estimate_memory,
  which must agree up to padding) and beside what plain data parallelism and every other stage
  and offload option would need in that format, and this option in the other state formats;
  then peak memory, communication per step (`Engine.comm_report()`) and the time split (with
  `wall_clock_breakdown: true`): forward, backward, optimizer step, and the part of them spent
  waiting for collectives.
"""
from __future__ import annotations

import collections
import time

import torch

from zero.components import Component
from zero.estimate import format_bytes as _bytes


class TrainingMonitor(Component):
    """A tqdm progress bar on rank 0 and the end-of-run table (see [Note: what the monitor measures]),
    the engine's "monitor" component (see [Note: engine components]).

    Args:
        engine: the zero engine being trained.
        steps: optimizer steps the run will take (the bar's length).
        tokens_per_step: tokens (or samples) one optimizer step consumes over all ranks, for the
            throughput; None leaves it out.
        unit: what `tokens_per_step` counts ("tok", "vox", "sample", ...).
        window: optimizer steps in the moving window of the time per step.
        memory_every: gather every rank's memory every this many steps.
        description: the bar's label.
    """

    name = "monitor"

    def __init__(self, engine, steps: int, tokens_per_step: int | None = None, unit: str = "tok",
                 window: int = 20, memory_every: int = 10, description: str = "train"):
        from tqdm.auto import tqdm

        self.engine = engine
        # every data-parallel rank (replicas too, under hybrid sharding); the states are sharded over `shards`
        dp = getattr(engine, "dp", engine.comm)
        self.rank, self.world, self.shards = dp.rank, dp.world_size, engine.comm.world_size
        self.tokens_per_step, self.unit = tokens_per_step, unit
        self.memory_every = max(1, memory_every)
        self.durations: collections.deque[float] = collections.deque(maxlen=max(1, window))
        self.timed_steps = 0  # optimizer steps inside the wall-clock totals (all but the first)
        self.seen_steps = engine.global_steps
        self.last_time: float | None = None
        self.loss: float | None = None
        self.rank_memory: list[float] = []
        self.summary: dict = {}  # the end table's numbers (rank 0, after `report`)
        self.bar = tqdm(total=steps, desc=description, unit="step", disable=self.rank != 0, dynamic_ncols=True)
        self.example = None  # the first micro-batch's inputs, as meta tensors (for the activations' trace)
        self._capture = engine.module.register_forward_pre_hook(self._capture_inputs, with_kwargs=True)
        self._peak: StepPeak | None = None
        self.timed_from = 2  # the first step inside the wall-clock totals
        self.step_peak: float | None = None  # this rank's measured peak of one step (bytes)
        self.peak_before_step = 0  # CUDA: the allocator's peak before StepPeak reset it
        engine.add_component(self)

    def _capture_inputs(self, module, args, kwargs) -> None:
        as_meta = lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta", requires_grad=t.requires_grad) \
            if isinstance(t, torch.Tensor) else t
        self.example = (tuple(as_meta(a) for a in args), {k: as_meta(v) for k, v in kwargs.items()})
        self._capture.remove()

    # -- during training ------------------------------------------------------------------------

    def step(self, loss: torch.Tensor | float | None = None) -> None:
        """Call after every `engine.step()` on every rank with the micro-batch's loss, for the bar
        (the monitor counts the steps itself, as the engine's "monitor" component)."""
        if loss is not None and self.rank == 0:
            self.loss = float(loss.detach().float().item() if torch.is_tensor(loss) else loss)
        if self.rank == 0:
            self.bar.set_postfix_str(self._postfix(), refresh=False)

    def after_step(self, engine, applied: bool) -> None:
        """At each accumulation boundary (see [Note: engine components]): the step's time, every
        rank's memory now and then, the bar."""
        if self.engine.global_steps == self.seen_steps:
            return
        self.seen_steps = self.engine.global_steps
        now = time.perf_counter()
        if self.last_time is None:  # the first step: ops built, orders recorded; measure the next one's peak
            self._peak = StepPeak(self.engine)
            self.peak_before_step = self._peak.before
        elif self._peak is not None:  # the measured step (slower on the CPU): the clocks start after it
            self.step_peak, self._peak = self._peak.stop(), None
            self.engine.wall_clock_report(reset=True)
            self.timed_from = self.seen_steps + 1
        else:
            self.durations.append(now - self.last_time)
            self.timed_steps += 1
        self.last_time = time.perf_counter()
        if self.seen_steps % self.memory_every == 0 or self.seen_steps == 1:
            self.rank_memory = self._gather([self._memory_now()])
        if self.rank == 0:
            self.bar.update(1)
            self.bar.set_postfix_str(self._postfix(), refresh=False)

    def _postfix(self) -> str:
        parts = []
        if self.loss is not None:
            parts.append(f"loss {self.loss:.3f}")
        if self.durations:
            per_step = sum(self.durations) / len(self.durations)
            parts.append(f"{per_step * 1e3:.0f} ms/step")
            if self.tokens_per_step:
                parts.append(f"{self.tokens_per_step / per_step:,.0f} {self.unit}/s")
        if self.rank_memory:
            parts.append("mem " + " ".join(f"r{r}:{_bytes(b)}" for r, b in enumerate(self.rank_memory)))
        return ", ".join(parts)

    def _memory_now(self) -> float:
        if self.engine.device.type == "cuda":
            return float(torch.cuda.memory_allocated(self.engine.device))
        report = self.engine.memory_report()
        return float(report["device_bytes"] + report["host_bytes"])

    def _gather(self, values: list[float]) -> list[float]:
        """Every rank's `values`, concatenated in rank order (on the control group)."""
        mine = torch.tensor(values, dtype=torch.float64)
        if self.world == 1:
            return mine.tolist()
        out = torch.zeros(self.world * len(values), dtype=torch.float64)
        getattr(self.engine, "dp", self.engine.comm).control().all_gather(out, mine)
        return out.tolist()

    def _activations(self):
        """(The activations of the first micro-batch's shapes, None) or (None, why there are none)."""
        if self.example is None:
            return None, "no forward seen"
        if self.engine.mesh is not None and self.engine.mesh.pp > 1:
            return None, "not for pipelines"
        from zero.estimate import estimate_activations

        example, spatial = self.example, {}
        layout = getattr(self.engine, "spatial", None)
        if layout is not None:  # a split volume: its slab's trace, from the whole volume's shapes
            if len(layout.dims) > 1:
                return None, "not traced (grid)"
            example, spatial = self._whole, dict(spatial_parallel_size=layout.comm.world_size,
                                                 spatial_dim=layout.dims[0])
        try:
            # the CPU kernels' scratch is measured here: it is only this run's on the CPU
            return estimate_activations(self.engine.module, example, kernel_scratch=self.engine.device.type == "cpu",
                                        **spatial), None
        except Exception as err:  # noqa: BLE001 - a model the trace cannot run must not end the run's report
            return None, f"not traced ({type(err).__name__})"

    def _whole_volume(self, layout):
        """The first micro-batch's example with each slabbed tensor's split dimension at its whole
        length (the lengths all-gathered over the spatial group: every rank calls it)."""
        from zero.spatial.halo import Split

        dim = layout.dims[0]
        args, kwargs = self.example

        def whole(t):
            if not isinstance(t, torch.Tensor) or t.dim() <= dim:
                return t
            shape = list(t.shape)
            shape[dim] = Split.of(shape[dim], layout.comm).length
            return torch.empty(shape, dtype=t.dtype, device="meta")

        return tuple(whole(a) for a in args), {k: whole(v) for k, v in kwargs.items()}

    # -- at the end -----------------------------------------------------------------------------

    def report(self) -> str:
        """The end table on rank 0 ("" elsewhere). Collective: every rank calls it."""
        from zero.estimate import estimate_memory

        self.bar.close()
        engine = self.engine
        measured = engine.memory_report()
        if engine.device.type == "cuda":
            peak = float(max(torch.cuda.max_memory_allocated(engine.device), self.peak_before_step))
        else:
            peak = float(measured["model_states_total"] + measured["host_staging"] + measured["reduce_buffers_peak"]
                         + sum(measured.get(k, 0) for k in ("gathered_peak", "gather_buffers_peak", "hpz_secondary_peak",
                                                            "collective_temporaries_peak")))
        comm = engine.comm_report()
        times = engine.wall_clock_report()
        mine = [measured["model_states_total"], measured["device_bytes"], measured["host_bytes"], peak,
                sum(c["bytes"] for c in comm.values()), -1.0 if self.step_peak is None else self.step_peak,
                sum(c.get("cross_node_bytes", 0) for c in comm.values())]
        k = len(mine)
        everyone = self._gather([float(v) for v in mine])
        layout = getattr(engine, "spatial", None)
        if layout is not None and len(layout.dims) == 1 and self.example is not None:
            self._whole = self._whole_volume(layout)  # collective: before rank 0 goes on alone
        if self.rank != 0:
            return ""
        per_rank = [everyone[r * k : (r + 1) * k] for r in range(self.world)]
        self.summary = {"model_states": [v[0] for v in per_rank], "device": [v[1] for v in per_rank],
                        "host": [v[2] for v in per_rank], "peak": [v[3] for v in per_rank],
                        "comm_bytes": [v[4] for v in per_rank], "step_peak": [v[5] for v in per_rank],
                        "cross_node_bytes": [v[6] for v in per_rank]}
        zc = engine.config.zero_optimization
        opt = zc.offload_optimizer is not None and zc.offload_optimizer.device in ("cpu", "nvme")
        param = zc.stage == 3 and zc.offload_param is not None and zc.offload_param.device in ("cpu", "nvme")
        on_nvme = [name for name, section in (("optimizer", zc.offload_optimizer), ("param", zc.offload_param))
                   if section is not None and section.device == "nvme"]
        nvme = True if len(on_nvme) == 2 else on_nvme[0] if on_nvme else False
        offload = {(False, False): "none", (True, False): "optimizer", (False, True): "param",
                   (True, True): "optimizer+param"}[(opt, param)]
        # zero's Adam steps (also for an Adam object given with another optimizer.type): count the state
        # format it stores, which a client optimizer object can choose too; other optimizers have none
        config, kind = engine.config, engine.config.optimizer.type if engine.config.optimizer is not None else None
        fmt = getattr(getattr(engine.optimizer, "precision", None), "adam", None)
        groups = getattr(engine.optimizer, "param_groups", [])
        muon = [p for g in groups if g.get("use_muon") for p in g["params"]]  # Muon's matrices
        adam = fmt is not None and getattr(engine.optimizer, "client", None) is None and \
            kind not in ("OneBitAdam", "ZeroOneAdam") and not muon
        formats = dict(master_dtype=fmt.master, state_dtype=fmt.state) if adam else {}
        if muon:
            formats["muon_params"] = muon
        if adam:
            config = {k: v for k, v in config.model_dump(by_alias=True, exclude_unset=True).items() if k != "optimizer"}
        activations, why_not = self._activations()
        group = engine.comm  # the shard group's ranks on this node (all of them, when nodes are not known)
        per_node = group.node_of.count(group.node_of[group.rank]) if group.node_of is not None else self.shards
        table = estimate_memory(engine.module, self.shards, dtype=engine.config.precision, config=config,
                                gpus_per_node=per_node, activations=activations, nvme=nvme, **formats)
        this = table.row(zc.stage, offload)
        formats_table = estimate_memory(engine.module, self.shards, stage=zc.stage, offload=offload,
                                        dtype=engine.config.precision, config=config, gpus_per_node=per_node,
                                        state_formats=True, nvme=nvme, **formats) if adam else []  # this one first
        on_cpu = engine.device.type != "cuda"  # one memory: the host's bytes are in the peak too
        predicted = this.peak_bytes + (this.host_bytes if on_cpu else 0)
        self.summary.update(estimate=this, table=table, state_formats=formats_table, activations=activations,
                            predicted_peak=predicted if activations is not None else None)

        ranks = [f"rank {r}" for r in range(self.world)]
        rows = [("model states, measured", [_bytes(v[0]) for v in per_rank]),
                ("model states, estimated", [_bytes(this.model_states_total)] * self.world),
                ("on the device / on the host", [f"{_bytes(v[1])} / {_bytes(v[2])}" for v in per_rank]),
                ("peak" + (" (CUDA allocator, whole run)" if engine.device.type == "cuda" else " of the states + buffers"),
                 [_bytes(v[3]) for v in per_rank])]
        if any(v[5] >= 0 for v in per_rank):
            rows.append((f"peak of step {self.timed_from - 1}, measured (allocator)",
                         [_bytes(v[5]) if v[5] >= 0 else "-" for v in per_rank]))
        rows.append(("peak, estimated (+ activations)", [_bytes(predicted) if activations is not None else why_not]
                     * self.world))
        lines = [f"{this.label} on {self.world} rank(s), {engine.config.precision}, {this.state_format}, "
                 f"{engine.device.type}; {table.psi:,} trainable parameters", ""]
        lines += _columns(["memory per rank", *ranks], [[name, *vals] for name, vals in rows])
        lines += ["", f"what each option needs per rank in {this.state_format} (zero.estimate_memory; * = this run):"]
        lines += _columns(["option", "model states", "device", "host"],
                          [[("* " if r is this else "  ") + r.label, _bytes(r.model_states_total), _bytes(r.device_bytes),
                            _bytes(r.host_bytes)] for r in table])
        ddp = table.row(0)
        device = max(v[1] for v in per_rank)
        lines.append(f"plain data parallelism keeps {_bytes(ddp.model_states_total)} of model states per rank on the "
                     f"device; this run {_bytes(device)} on the device ({ddp.model_states_total / max(1.0, device):.1f}x "
                     f"less), {_bytes(max(v[2] for v in per_rank))} on the host")
        p, g = this.element_bytes
        if this.muon_params and p < 4:  # mixed precision (in fp32, Adam's master is the parameter itself)
            lines.append(f"Muon updates {this.muon_params:,} of the {table.psi:,} parameters, keeping one fp32 momentum "
                         f"each: {p + g + 8} B per parameter over all ranks at stage 3 (Adam's: {p + g + 12}); this run "
                         f"holds {this.bytes_per_param(table.psi):.1f} B per trainable parameter over all ranks")
        if formats_table:
            lines += ["", f"{this.label} in each state format (master weights + Adam's moments; docs/config.md):"]
            lines += _columns(["state format", "model states", "device", "host"],
                              [[("* " if i == 0 else "  ") + r.state_format, _bytes(r.model_states_total),
                                _bytes(r.device_bytes), _bytes(r.host_bytes)] for i, r in enumerate(formats_table)])
        lines += _swap_lines(engine, self.world)
        sent = max(v[4] for v in per_rank)
        detail = ", ".join(f"{name} {_bytes(c['bytes'])} in {c['calls']}" for name, c in comm.items() if c["calls"])
        lines += ["", f"communication per step (last step, the most any rank sent): {_bytes(sent)}"
                  + (f"; rank 0: {detail}" if detail else "")]
        crossing = max(v[6] for v in per_rank)
        if crossing:  # see [Note: the byte ledger] in zero/parallel/comm.py
            text, self.summary["cross_node_formula"] = _cross_node_formula(engine)
            lines.append(f"of which across nodes (the most of any rank): {_bytes(crossing)}; the rest stayed inside "
                         f"a node" + text)
        if self.timed_steps and engine.config.wall_clock_breakdown:
            n = self.timed_steps
            ms = {key: times.get(key, 0.0) / n * 1e3 for key in ("forward", "backward", "step", "communication_wait")}
            wait = (f"; of which the host waited for collectives {ms['communication_wait']:.1f} ms"
                    if engine.comm.backend == "gloo" else "")
            lines.append(f"time per step (mean of steps {self.timed_from}-{self.seen_steps}, rank 0): forward {ms['forward']:.1f} ms, "
                         f"backward {ms['backward']:.1f} ms, optimizer step {ms['step']:.1f} ms{wait}")
        elif not engine.config.wall_clock_breakdown:
            lines.append("time split: set \"wall_clock_breakdown\": true in the config")
        if self.durations and self.tokens_per_step:
            per_step = sum(self.durations) / len(self.durations)
            lines.append(f"throughput (last {len(self.durations)} steps): {self.tokens_per_step / per_step:,.0f} "
                         f"{self.unit}/s, {per_step * 1e3:.0f} ms/step")
        return "\n".join(lines) + "\n"


def _cross_node_formula(engine) -> tuple[str, float | None]:
    """The formula's bytes across nodes per step for this run (zero.estimate.comm), to print beside
    the ledger's, and the number; ("", None) where the run's layout has none (a mesh, stage 0)."""
    from zero.estimate.comm import cross_node_bytes

    storage, comm, stage = engine.optimizer.storage, engine.comm, engine.config.zero_optimization.stage
    precision = getattr(engine.optimizer, "precision", None)
    if engine.mesh is not None or precision is None or stage == 0 or comm.node_of is None:
        return "", None
    hybrid = engine.replicate is not None
    world = engine.dp.world_size if hybrid else comm.world_size
    local = comm.world_size if hybrid else comm.node_of.count(comm.node_of[comm.rank])
    psi = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for g in engine.optimizer.param_groups
              for p in g["params"])
    units = sum(u.full_numel for u in getattr(storage, "units", []) if not u.persistent)
    hpz = stage == 3 and engine.config.zero_optimization.zero_hpz_partition_size > 1
    qwz = stage == 3 and engine.config.zero_optimization.zero_quantized_weights
    qgz = stage == 3 and engine.config.zero_optimization.zero_quantized_gradients
    predicted = cross_node_bytes(stage, world, local, engine.config.gradient_accumulation_steps, psi, units, hybrid,
                                 precision.param.itemsize, precision.reduce.itemsize, hpz, qwz, qgz,
                                 precision.grad.itemsize,
                                 stage == 3 and engine.config.zero_optimization.mics_hierarchical_params_gather)
    note = "" if stage < 3 or hybrid else " with every unit gathered for forward" + ("" if hpz else " and again for backward")
    return f" (the formula{note}: {_bytes(predicted)}; zero.estimate.comm)", predicted


def _swap_lines(engine, world: int) -> list[str]:
    """NVMe offload: what rank 0 keeps on disk, its last step's reads and writes, and the drive
    writes that make per 1,000 steps on a host of `LOCAL_WORLD_SIZE` such ranks."""
    import os

    store, swap = engine.optimizer.storage.store, getattr(engine.optimizer.storage, "swap", None)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    lines = []
    if store.policy.on_disk:
        read, written = store.step_bytes["read"], store.step_bytes["written"]
        lines.append(f"NVMe offload (rank 0, {store.policy.path}): {_bytes(store.size)} of optimizer state on disk; last "
                     f"step read {_bytes(read)} and wrote {_bytes(written)}, so {local} such rank(s) on a host write "
                     f"{written * local * 1000 / 1e12:.3g} TB to its drive per 1,000 steps (compare the drive's TBW "
                     f"rating)")
    if swap is not None:
        steps = max(1, engine.global_steps)
        lines.append(f"parameters on NVMe (rank 0, {swap.policy.path}): {_bytes(swap.size)} of shards on disk, "
                     f"{_bytes(swap.bytes['read'] / steps)} read per step ({swap.reads['ahead']} reads ahead of "
                     f"their gathers, {swap.reads['on_demand']} on demand), {_bytes(swap.bytes['written'] / steps)} "
                     f"written per step")
    return [""] + lines if lines else []


def _columns(head: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return [fmt(head), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)]


class StepPeak:
    """The most memory this rank holds during one step, measured at the allocator from now until
    `stop()` (see [Note: what the monitor measures]); None from `stop()` when it cannot be
    measured (another profiler is running)."""

    def __init__(self, engine):
        self.device = engine.device
        self.base, self.probe, self.before = 0, None, 0
        if self.device.type == "cuda":  # the run's peak so far is kept in `before`
            torch.cuda.synchronize(self.device)
            self.before = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        elif not torch.autograd.profiler._is_profiler_enabled:
            from zero.probes import AllocatorPeak

            report = engine.memory_report()  # what the engine holds as the step starts
            self.base = (report["model_states_total"] + report["host_staging"] + report["reduce_buffers"]
                         + report.get("gathered_bytes", 0))
            self.probe = AllocatorPeak().__enter__()

    def stop(self) -> float | None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return float(torch.cuda.max_memory_allocated(self.device))
        if self.probe is None:
            return None
        self.probe.__exit__(None, None, None)
        return float(self.base + self.probe.peak)
