"""qwZ's all-gather: each rank sends its shard as int8 weight blocks (see [Note: int8 weight
blocks] in zero/zeropp/blocks.py) and every rank decodes all the messages into the gathered
buffer, on waiting for the collective."""
from __future__ import annotations

import torch

from zero.parallel.comm import Comm, Then
from zero.zeropp.blocks import Held, dequantize, message_bytes, quantize

LABEL = "all_gather (qwZ)"  # its line in the comm report and the byte ledger


def all_gather_quantized(comm: Comm, full: torch.Tensor, mine: torch.Tensor, async_op: bool = False, gauge=None):
    """Every rank's part `mine` (n elements) into `full` (its first world * n elements, rank
    order), sent as int8 weight blocks; the messages' bytes count on `gauge` (a BufferGauge, or
    None) until they are decoded. Returns the handle (async_op), else None once done."""
    n, world = mine.numel(), comm.world_size
    if full.numel() < world * n or not full.is_contiguous():
        raise ValueError(f"qwZ all-gather: the output holds {full.numel()} elements (contiguous: "
                         f"{full.is_contiguous()}); {world} ranks x {n} need a contiguous {world * n}")
    message = quantize(mine)
    messages = torch.empty(world, message_bytes(n), dtype=torch.uint8, device=mine.device)
    held = Held(gauge)
    held.hold(message, messages)
    with held.on_error():
        work = comm.all_gather(messages.view(-1), message, async_op=True, label=LABEL)
    out = full.view(-1)[: world * n]

    def decode() -> None:  # the messages' memory goes with the handle
        try:
            dequantize(messages, n, out)
        finally:
            held.done()

    handle = Then(work, decode, held.done)
    if async_op:
        return handle
    handle.wait()
    return None
