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


def collective_temporaries(s3, unit: int, flight: int, n: int, local: int, p: int, r: int) -> int:
    """Stage 3's temporaries of ZeRO++'s quantized collectives and the two-hop gather (zero/zeropp),
    in bytes at most, what `memory_report()["collective_temporaries_peak"]` measures: the gathers of
    `flight` elements in flight at once (the largest unit `unit` and what stage3_prefetch_bucket_size
    fetches ahead) beside one quantized reduce-scatter of the largest unit, over `n` ranks with
    `local` of them per node, p and r the parameters' and reduced gradients' bytes per element.
    - qwZ: the int8 messages from every rank and its own, about F (1 + 1/n) bytes for F elements;
    - the two-hop gather: the parts from across nodes and from the node, p F (1 + 1/L);
    - qgZ: the parts in (place, node) order, the first hop's int8 sends and receipts, and the fp32
      sums of a node's parts, about r U + 2 U + 8 U / L.
    `s3`: the Stage3Options (which of them are on)."""
    from zero.ops.quant import message_bytes

    if n < 2 or unit < 1:
        return 0
    local, part = max(1, min(local, n)), math.ceil(flight / n)  # a rank's part of the gathers
    units = math.ceil(flight / unit)  # each unit's parts round up to whole words and blocks
    gathers = [0]
    if s3.quantize_weights or s3.quantize_frozen_weights:
        gathers.append((n + 1) * (message_bytes(part) + 8 * units))
    if s3.hierarchical_gather and local < n and not s3.quantize_weights:
        gathers.append(p * (part + units) * (n + n // local))
    part = math.ceil(unit / n)
    reduce = r * unit + 2 * local * message_bytes(part * (n // local)) + 8 * part * (n // local) \
        if s3.quantize_gradients else 0
    return max(gathers) + reduce
