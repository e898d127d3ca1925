"""qgZ: stage 3's gradient reduce-scatter as two quantized all-to-alls, inside the node, then
across nodes.

[Note: qgZ]
ZeRO++'s quantized gradients (`zero_quantized_gradients`). With N ranks as M nodes of L, rank
(m, l) (node m, place l in it) holds the gradients of every rank's part, N parts of n elements.
- Inside the node: to each rank (m, l') of its node it sends, as one int8 message (see [Note:
  int8 weight blocks] in zero/zeropp/blocks.py), the M parts of the ranks (*, l'): the parts
  whose owners sit at place l' of some node. Each rank sums (in fp32, in the node's rank order)
  the L messages it gets: the node's partial sums of the M parts owned at its place.
- Across nodes: among the ranks at place l of every node, it sends each (m', l) the node's
  partial sum of (m', l)'s part, as an int8 message; the sum of the M messages it gets is its own
  part's sum over all N ranks.
Each rank sends (M - 1) messages of n elements across nodes, where a flat reduce-scatter sends
L (M - 1) parts of n at the gradients' width: 1 / L of the parts, at about half the bytes of
bf16. Any n works (the blocks' last one is ragged). Rounding happens twice: each gradient's value
is within half a step of its block (its amax / 254) at each hop, so the sum's error is bounded by
the sums of those steps; the optimizer's masters and states are exact. One hop is skipped where
it moves nothing (one node: no second hop; one rank per node: no first).

[Note: the two-hop gather]
MiCS's hierarchical all-gather (`mics_hierarchical_params_gather`, stage 3) uses the same groups
the other way round: each rank first gathers the parts of the ranks at its place of every node
(M - 1 parts of n elements come in across nodes), then the node's ranks gather those M parts from
each other (inside the node). Every rank ends with all N parts, exactly (copies), having received
(M - 1) n elements across nodes instead of (N - L) n: 1 / L of a flat all-gather's.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from zero.parallel.comm import Comm, Then
from zero.zeropp.blocks import Held, dequantize, message_bytes, quantize

NODE, ACROSS = "all_to_all (qgZ, node)", "all_to_all (qgZ, across)"  # their lines in the comm report
GATHER_ACROSS, GATHER_NODE = "all_gather (two-hop, across)", "all_gather (two-hop, node)"


class TwoHop:
    """qgZ's two groups for the ranks of `comm`: this rank's node, and the ranks at its place in
    every node. Made once, when the engine is built (every rank of `comm` makes its own). The
    temporaries of its reduces and gathers count on `gauge` (a BufferGauge, or None)."""

    def __init__(self, comm: Comm, gauge=None):
        from zero.parallel.groups import group_of

        node_of = comm.node_of if comm.node_of is not None else [0] * comm.world_size
        nodes: dict[int, list[int]] = {}
        for r, node in enumerate(node_of):
            nodes.setdefault(node, []).append(r)
        sizes = {len(ranks) for ranks in nodes.values()}
        if len(sizes) > 1:
            raise ValueError(f"zero_optimization.zero_quantized_gradients: the ranks per node differ "
                             f"({sorted(len(r) for r in nodes.values())}); qgZ's two hops need the same number on "
                             f"every node")
        self.comm, self.gauge = comm, gauge
        self.rank_at = list(nodes.values())  # rank_at[m][l]: the comm rank at place l of node m
        self.nodes, self.local = len(self.rank_at), sizes.pop()
        self.node = next(m for m, ranks in enumerate(self.rank_at) if comm.rank in ranks)
        self.place = self.rank_at[self.node].index(comm.rank)
        # a group numbers its ranks in rank order: the nodes in the order of their ranks at place l
        # (not always the nodes' own order: nodes [0, 1, 1, 0] have ranks 3 and 2 at place 1)
        orders = [sorted(range(self.nodes), key=lambda m, at=at: self.rank_at[m][at]) for at in range(self.local)]
        # laid out once, used by every reduce and gather: the comm ranks (place, node) in node order,
        # the across group's order of this place's nodes, and the comm rank of each gathered row
        self._by_place = _Rows([self.rank_at[m][at] for at in range(self.local) for m in range(self.nodes)])
        self._across_order = _Rows(orders[self.place])
        self._gathered = _Rows([self.rank_at[m][at] for at in range(self.local) for m in orders[at]])
        members = dist.get_process_group_ranks(comm.group or dist.group.WORLD) if comm.distributed else [0]
        placed = {members[r]: node_of[r] for r in range(comm.world_size)}

        def sub(ranks: list[int]) -> Comm:
            c = Comm(group_of([members[r] for r in ranks]))
            c.place_on_nodes({members[r]: placed[members[r]] for r in ranks})
            return c

        self.in_node = sub(self.rank_at[self.node]) if self.local > 1 else None
        self.across = sub([ranks[self.place] for ranks in self.rank_at]) if self.nodes > 1 else None

    def all_gather(self, full: torch.Tensor, mine: torch.Tensor, async_op: bool = False):
        """Every rank's part `mine` (n elements) into `full` (its first N n elements, rank order)
        in two hops: across nodes among the ranks at this rank's place, then inside the node (see
        [Note: the two-hop gather]). Returns the handle (async_op), else None once done."""
        n, nodes = mine.numel(), self.nodes
        across = torch.empty(nodes * n, dtype=mine.dtype, device=mine.device)
        held = Held(self.gauge)
        held.hold(across)
        with held.on_error():
            work = self.across.all_gather(across, mine.contiguous(), async_op=True, label=GATHER_ACROSS) \
                if self.across is not None else None
        if work is None:
            across.copy_(mine.reshape(-1))
        out = full.view(-1)[: self.comm.world_size * n].view(self.comm.world_size, n)
        handle = Then(work, lambda: self._inside_node(across, out, held), held.done)
        if async_op:
            return handle
        handle.wait()
        return None

    def _inside_node(self, across: torch.Tensor, out: torch.Tensor, held: Held) -> None:
        """The gather's second hop, once the first arrived: the node's ranks share what each got
        across nodes, and every part goes to its rank's row of `out`."""
        try:
            both = across
            if self.in_node is not None:
                both = torch.empty(self.local * across.numel(), dtype=across.dtype, device=across.device)
                held.hold(both)
                self.in_node.all_gather(both, across, label=GATHER_NODE)
            # row (place, g): the part of the g-th rank at that place, which goes to its comm rank
            self._gathered.put(out, both.view(self.local * self.nodes, out.shape[1]))
        finally:
            held.done()

    def side_comms(self) -> list[Comm]:
        """Its groups, whose counts join the comm report."""
        return [c for c in (self.in_node, self.across) if c is not None]

    @torch.no_grad()
    def reduce_scatter(self, mine: torch.Tensor, buf: torch.Tensor) -> None:
        """SUM `buf` (this rank's gradients: the comm's N ranks' parts, n elements each, in rank
        order) over the ranks into `mine` (this rank's part, n elements; may be a view of `buf`)."""
        n, nodes, local = mine.numel(), self.nodes, self.local
        held = Held(self.gauge)
        try:
            # the parts owned at each place of each node: (place, node, n)
            by_place = self._by_place.take(buf.view(self.comm.world_size, n)).view(local, nodes * n)
            held.hold(by_place, of=buf)
            if self.in_node is None:
                partial = by_place[0].float().view(nodes, n)
                held.hold(partial, of=by_place)
            else:
                partial = _sum_messages(self.in_node, by_place, NODE, held).view(nodes, n)
            if self.across is None:
                mine.copy_(partial[0])
            else:  # row g to the g-th rank of the group across nodes
                rows = self._across_order.take(partial)
                held.hold(rows, of=partial)
                mine.copy_(_sum_messages(self.across, rows, ACROSS, held))
        finally:
            held.done()


class _Rows:
    """A fixed order of rows: `take` reads them in it, `put` writes rows back to their places; the
    identity order costs nothing, another one an index kept per device."""

    def __init__(self, order: list[int]):
        self.order = order
        self.identity = order == list(range(len(order)))
        self._index: dict[torch.device, torch.Tensor] = {}

    def _on(self, device: torch.device) -> torch.Tensor:
        if device not in self._index:
            self._index[device] = torch.tensor(self.order, device=device)
        return self._index[device]

    def take(self, rows: torch.Tensor) -> torch.Tensor:
        return rows if self.identity else rows.index_select(0, self._on(rows.device))

    def put(self, out: torch.Tensor, rows: torch.Tensor) -> None:
        if self.identity:
            out.copy_(rows)
        else:
            out.index_copy_(0, self._on(out.device), rows)


def _sum_messages(comm: Comm, rows: torch.Tensor, label: str, held: Held) -> torch.Tensor:
    """Row i of `rows` to rank i of `comm` as an int8 message; the fp32 sum of the messages this
    rank gets (in rank order). Its temporaries count on `held`; the sum stays held."""
    k, width = rows.shape
    size = message_bytes(width)
    send = torch.empty(k, size, dtype=torch.uint8, device=rows.device)
    for i in range(k):
        quantize(rows[i], out=send[i])
    got = torch.empty_like(send)
    held.hold(send, got)
    comm.all_to_all(got, send, label=label)
    held.drop(send)
    del send
    total = torch.zeros(width, dtype=torch.float32, device=rows.device)
    one = torch.empty(width, dtype=torch.float32, device=rows.device)  # one row decoded at a time
    held.hold(total, one)
    for i in range(k):
        dequantize(got[i : i + 1], width, one)
        total += one
    held.drop(got, one)
    return total
