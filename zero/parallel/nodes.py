"""Which ranks share a node: torchrun's node rank and the host name, known to every rank.

A node is a host name and, where there is one, torchrun's node rank (GROUP_RANK; SLURM_NODEID under
srun): two torchrun agents on one host (`--nnodes 2 --node-rank 0/1`) are two nodes, with no other
setting. Node-local checkpoints (zero/checkpoint/nodes.py) and the byte ledger of the comm report
(see [Note: the byte ledger] in zero/parallel/comm.py) read it.
"""
from __future__ import annotations

import os
import socket

import torch.distributed as dist


def node_name() -> str:
    """This process's node: its host name, and torchrun's node rank where there is one."""
    rank = os.environ.get("GROUP_RANK") or os.environ.get("SLURM_NODEID")
    return socket.gethostname() + (f"/node{rank}" if rank is not None else "")


def node_of_ranks() -> list[int]:
    """Each global rank's node, numbered in the order of their lowest ranks. Collective: every rank
    says its node; [0] without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return [0]
    from zero.parallel.comm import Comm

    names = Comm(None).all_gather_object(node_name(), label="nodes")  # bounded, like zero's other waits
    index: dict[str, int] = {}
    return [index.setdefault(n, len(index)) for n in names]
