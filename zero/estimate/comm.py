"""The bytes a training step sends across nodes, by formula: what the comm report's byte ledger
should count (see [Note: the byte ledger] in zero/parallel/comm.py). The end table prints the two
side by side, and benchmarks/bench_multinode.py checks them against each other for every layout.

Per rank and optimizer step, with N data-parallel ranks, L of them per node, a micro-steps per
step, Psi the trainable elements, Psi_u the elements stage 3 gathers per pass (its units that are
not persistent), p the parameters' bytes per element, r the reduced gradients', and
s = (N - L) / N the share of the group's ranks on other nodes:
- flat stage 3: a (2 p Psi_u + r Psi) s, when every micro-step gathers the units for forward and
  again for backward (no reuse across them) and reduce-scatters the gradients; with hpZ
  (`zero_hpz_partition_size` = L) backward gathers inside the node: a (p Psi_u + r Psi) s; with
  qwZ (`zero_quantized_weights`) the gathers send q = 1 + 4/256 bytes per element instead of p
  (int8 codes and one fp32 scale per block of 256; see zero/zeropp/blocks.py); with qgZ
  (`zero_quantized_gradients`) the reduction sends one q-byte message of its part to each other
  node, q Psi s / L in place of r Psi s (see [Note: qgZ] in zero/zeropp/reduce.py); with the
  two-hop gather (`mics_hierarchical_params_gather`) a gather's p Psi_u s becomes p Psi_u s / L;
- flat stage 2: a r Psi s + p Psi s: a reduce-scatter per micro-step, one all-gather per step;
- flat stage 1: (r Psi + p Psi) s: both once per step;
- hybrid sharding (shard groups of L ranks, R = N / L replicas): 2 g (Psi / L) (R - 1) / R, the
  replicas' all-reduce of this rank's gradient shard once per step, with g the gradient shards'
  bytes per element at stages 2-3 (4 when a > 1: they accumulate in fp32, unless the master and
  gradients are bf16), else r. Nothing else crosses.
The gradient norm's all-reduce (a few bytes) is left out.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


def cross_node_bytes(stage: int, world: int, local: int, accumulation: int, psi: int, psi_units: int = 0,
                     hybrid: bool = False, p: int = 2, r: int = 2, hpz: bool = False, qwz: bool = False,
                     qgz: bool = False, g: int | None = None, hierarchical: bool = False) -> float:
    """Bytes per rank and optimizer step that cross a node boundary (see the module's docstring).

    Args:
        stage: the ZeRO stage (1-3).
        world: data-parallel ranks N.
        local: of them, the ranks of one node L (with `hybrid`, the shard group's size).
        accumulation: micro-steps per optimizer step.
        psi: trainable elements.
        psi_units: elements stage 3 gathers per pass.
        hybrid: shard groups of `local` ranks, replicated across nodes.
        p, r: bytes per parameter element and per reduced-gradient element.
        hpz: stage 3 with hpZ over the ranks of a node (backward's gathers stay inside it).
        qwz: stage 3's gathers send int8 weight blocks.
        qgz: stage 3's reduce-scatter is qgZ's two quantized hops.
        g: bytes per element of the gradient shards (stages 2-3; default 4 when accumulation > 1,
            else r).
        hierarchical: stage 3's all-gathers run in two hops (`mics_hierarchical_params_gather`):
            1 / L of their bytes cross.
    """
    if hybrid:
        replicas = world // local
        if stage < 2:
            g = r
        elif g is None:
            g = 4 if accumulation > 1 else r
        return 2 * g * (psi / local) * (replicas - 1) / replicas
    share = (world - local) / world
    if stage == 3:
        q = 1 + 4 / 256
        gathered, reduced = (q if qwz else p) / (local if hierarchical and not qwz else 1), q / local if qgz else r
        return accumulation * ((1 if hpz else 2) * gathered * psi_units + reduced * psi) * share
    if stage == 2:
        return (accumulation * r + p) * psi * share
    return (r + p) * psi * share


@dataclass(frozen=True)
class Gathered:
    """What stage 3's all-gathers carry, for `collective_temporaries`: the elements of the units qwZ
    quantizes and of the exact ones (frozen parameters too), the largest unit's, the persistent
    elements (refreshed after a step), `pad`, the parameters (each rounds its shard up), and the
    number of units."""

    quantized: int
    exact: int
    largest: int
    persistent: int = 0
    pad: int = 0
    units: int = 1

    @classmethod
    def of_units(cls, s3, units: list, kept: list, numel) -> Gathered:
        """From `units` and `kept` as zero.stages.planning.plan_units gives them; `numel(p)`: a
        parameter's elements."""
        sizes = {True: 0, False: 0}
        for _, ps in units:
            sizes[bool(s3.quantize_weights or s3.quantize_frozen_weights and all(not q.requires_grad for q in ps))] += \
                sum(numel(q) for q in ps)
        return cls(sizes[True], sizes[False], max((sum(numel(q) for q in ps) for _, ps in units), default=0),
                   sum(numel(q) for q in kept), sum(len(ps) for _, ps in units) + len(kept), max(1, len(units)))

    @classmethod
    def of_count(cls, s3, elements: int, largest: int, persistent: int) -> Gathered:
        """For a parameter count: `elements` in units of at most `largest`; with qwZ for frozen
        weights only, either kind may be all of them."""
        return cls(elements if s3.quantize_weights or s3.quantize_frozen_weights else 0,
                   0 if s3.quantize_weights else elements, largest, persistent)


def collective_temporaries(s3, gathered: Gathered, n: int, local: int, p: int, r: int, reduce_unit: int) -> int:
    """Stage 3's temporaries of ZeRO++'s quantized collectives and the two-hop gather (zero/zeropp),
    in bytes at most: what `memory_report()["collective_temporaries_peak"]` measures. Over `n` ranks,
    `local` of them per node, with p and r the parameters' and reduced gradients' bytes per element:
    - the gathers in flight at once: F elements, the largest unit (the one waited for) and what
      stage3_prefetch_bucket_size fetches ahead, as many of the dearer kind as there are: qwZ's
      int8 messages from every rank and its own (about 1.016 F (1 + 1/n) bytes), the two-hop
      gather's parts from across nodes and from the node (p F (1 + 1/L));
    - or, apart from forward and backward, the two-hop refresh of the persistent elements;
    - beside them (in backward, which may gather too) one qgZ reduce-scatter of
      `reduce_unit` elements (U): its parts in (place, node) order, its first hop's int8 sends and
      receipts, and fp32 sums, casts and reorders of a node's parts: about r U + 2 U + 12 U / L.
    `s3`: the Stage3Options (which of them are on)."""
    from zero.ops.quant import message_bytes

    if n < 2:
        return 0
    local = max(1, min(local, n))
    two_hop = s3.hierarchical_gather and local < n
    ahead = max(gathered.largest, s3.prefetch_elements) if s3.prefetch_elements > 0 else 0
    flight = min(gathered.quantized + gathered.exact, gathered.largest + ahead)

    def part(elements: int) -> int:  # a rank's part of gathers of `elements`
        return math.ceil(elements / n) + gathered.pad if elements > 0 else 0

    def qwz(elements: int) -> int:
        # (each unit's message rounds up to whole words and blocks: 7 bytes at most)
        return (n + 1) * (message_bytes(part(elements)) + 7 * gathered.units) if elements > 0 else 0

    def hop(elements: int) -> int:
        return p * part(elements) * (n + n // local) if two_hop else 0

    exact_first = p * (n + n // local) > 1.02 * (n + 1) and two_hop  # the dearer kind fills the flight first
    if exact_first:
        e = min(flight, gathered.exact)
        gather = hop(e) + qwz(min(flight - e, gathered.quantized))
    else:
        q = min(flight, gathered.quantized)
        gather = qwz(q) + hop(min(flight - q, gathered.exact))
    gather = max(gather, hop(gathered.persistent))
    part_, nodes = math.ceil(reduce_unit / n), n // local
    reduce = r * reduce_unit + 2 * local * message_bytes(part_ * nodes) + 12 * part_ * nodes \
        if s3.quantize_gradients and reduce_unit > 0 else 0
    # (with hpZ too: a backward that recomputes a forward run without grad, as activation
    # checkpointing does, gathers from the primary shards while it reduces)
    return gather + reduce
