"""A small training job for the crash tests: a GPT on a token dataset, periodic checkpoints with
auto_resume, and optionally one rank killed (SIGKILL) at a given step of the first attempt.

    python -m torch.distributed.run --standalone --nproc_per_node 2 --max-restarts 2 \\
        -m zero.testing.resume_job --dir CKPT --out final.safetensors --steps 9 --kill-at 5

Rank 0 writes the final parameters (safetensors) to --out and prints the step it started from;
every rank prints the node, local rank and local world size it was given and the engine reads.
`--dir` may name `{node}`, torchrun's node rank (GROUP_RANK), so that two agents on one host each
keep their checkpoints in a directory of their own, as nodes with node-local storage do.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time

import torch


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="checkpoint.dir")
    parser.add_argument("--out", required=True, help="where rank 0 writes the final parameters")
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--interval", type=int, default=2, help="checkpoint.save_interval")
    parser.add_argument("--stage", type=int, default=1)
    parser.add_argument("--offload", action="store_true", help="offload_optimizer to the CPU")
    parser.add_argument("--nvme", default=None, help="offload_optimizer to NVMe swap files in this directory")
    parser.add_argument("--kill-in-writeback", type=int, default=0, help="first attempt: --kill-rank dies while the "
                        "optimizer step that makes this step writes its NVMe tiles back (after the first write)")
    parser.add_argument("--optimizer", default="AdamW", choices=["AdamW", "SGD", "Lion", "Adagrad", "RMSprop"],
                        help="the config's optimizer type, or RMSprop: a client torch.optim.RMSprop")
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--kill-at", type=int, default=0, help="first attempt: --kill-rank kills itself after this step")
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--node-local", action="store_true", help="checkpoint.use_node_local_storage")
    parser.add_argument("--elastic", action="store_true", help="the batch from an elasticity section (12 for 1, 2, "
                        "3, 4, 6 or 12 ranks) instead of 2 per rank")
    parser.add_argument("--kill-in-save", type=int, default=0, help="first attempt: --kill-rank dies while writing "
                        "the save of this step (after its tensors, before the tag is published)")
    parser.add_argument("--kill-node-at", type=int, default=0, help="first attempt: node 1 dies after this step "
                        "(its agent and its ranks, SIGKILL)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    import zero
    from zero.deepspeed import comm as ds_comm
    from zero.models import GPT, GPTConfig

    directory = args.dir.replace("{node}", os.environ.get("GROUP_RANK", "0"))
    zo = {"stage": args.stage, **({"offload_optimizer": {"device": "cpu"}} if args.offload else {})}
    if args.nvme:  # small tiles in two buffers: a step writes many tiles back
        zo.update(sub_group_size=1024, offload_optimizer={"device": "nvme", "nvme_path": args.nvme, "buffer_count": 2})
    batch = ({"elasticity": {"enabled": True, "max_train_batch_size": 12, "micro_batch_sizes": [1, 2], "version": 0.1}}
             if args.elastic else {"train_micro_batch_size_per_gpu": 2})
    optimizer = {"AdamW": {"lr": 1e-3}, "SGD": {"lr": 0.05, "momentum": 0.9, "dampening": 0.1},
                 "Lion": {"lr": 1e-3}, "Adagrad": {"lr": 0.05, "initial_accumulator_value": 0.1}}.get(args.optimizer)
    config = {**batch, **({"optimizer": {"type": args.optimizer, "params": optimizer}} if optimizer else {}),
              "zero_optimization": zo,
              "checkpoint": {"dir": directory, "save_interval": args.interval, "keep_last": 2, "auto_resume": True,
                             "async_save": args.async_save, "use_node_local_storage": args.node_local}}
    torch.manual_seed(0)
    samples = 96 if args.elastic else 64
    data = torch.utils.data.TensorDataset(torch.randint(0, 64, (samples, 9), generator=torch.Generator().manual_seed(1)))
    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16))
    client = None if optimizer else torch.optim.RMSprop(model.parameters(), lr=1e-3, momentum=0.5)
    engine, _, loader, _ = zero.initialize(model=model, optimizer=client, training_data=data, config=config)
    rank, first_attempt = engine.comm.rank, os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if first_attempt and args.kill_in_save and rank == args.kill_rank:
        _die_in_save(engine, args.kill_in_save)
    if first_attempt and args.kill_in_writeback and rank == args.kill_rank:
        _die_in_writeback(engine, args.kill_in_writeback)
    from zero.checkpoint.nodes import Nodes
    from zero.checkpoint.placement import Placement
    from zero.deepspeed.accelerator import get_accelerator

    nodes = Nodes.of(Placement(engine).io)  # which ranks zero finds on one node
    print(f"resume_job: rank {rank} node {os.environ.get('GROUP_RANK')} LOCAL_RANK {os.environ.get('LOCAL_RANK')} "
          f"LOCAL_WORLD_SIZE {os.environ.get('LOCAL_WORLD_SIZE')} engine.local_rank {engine.local_rank} "
          f"comm.get_local_rank {ds_comm.get_local_rank()} world {ds_comm.get_world_size()} "
          f"devices {get_accelerator().device_count()} nodes {[list(r) for r in nodes.ranks]}", flush=True)
    if rank == 0:
        print(f"resume_job: attempt {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')} starts at step "
              f"{engine.global_steps}", flush=True)
    resumed_at = engine.global_steps
    while engine.global_steps < args.steps:
        for (batch,) in loader:
            engine.backward(engine(batch[:, :-1], batch[:, 1:]))
            boundary = engine.is_gradient_accumulation_boundary()
            engine.step()
            if not boundary:
                continue
            if rank == 0 and not first_attempt and engine.global_steps == resumed_at + 1:
                print(f"resume_job: first step after the restart at {time.time():.3f}", flush=True)
            if first_attempt and rank == args.kill_rank and engine.global_steps == args.kill_at:
                print(f"resume_job: rank {rank} killed after step {args.kill_at} at {time.time():.3f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)  # a dead rank: no cleanup, no exit code of its own
            if first_attempt and os.environ.get("GROUP_RANK") == "1" and engine.global_steps == args.kill_node_at:
                if int(os.environ["LOCAL_RANK"]) == 0:
                    print(f"resume_job: node 1 dies after step {args.kill_node_at} at {time.time():.3f}", flush=True)
                    os.kill(os.getppid(), signal.SIGKILL)  # its torchrun agent
                os.kill(os.getpid(), signal.SIGKILL)
            if engine.global_steps == args.steps:
                break
    engine.wait_for_checkpoint()
    state = engine.consolidated_16bit_state_dict()
    if rank == 0:
        from safetensors.torch import save_file

        save_file({k: v.detach().clone() for k, v in state.items()}, args.out)  # tied ones apart
    torch.distributed.barrier()
    engine.destroy()  # NVMe offload's swap files: os._exit below skips the finalizers that would remove them
    # out of the interpreter without its teardown, where gloo's threads can still abort a process
    # now and then ([Note: gloo at exit] in zero/parallel/process_group.py): torchrun would count that as a failure
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _die_in_writeback(engine, step: int) -> None:
    """Make this rank die (SIGKILL) in the middle of the NVMe write-back of the optimizer step that
    makes global step `step`: its swap file then holds that step's tiles in part."""
    io = engine.optimizer.storage.store.io
    write, writes = io.write, []

    def dying_write(f, buf, offset):
        request = write(f, buf, offset)
        if engine.global_steps == step - 1:
            writes.append(request)
            if len(writes) == 2:
                request.wait()
                print(f"resume_job: rank {engine.comm.rank} killed in the write-back of step {step} at "
                      f"{time.time():.3f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        return request

    io.write = dying_write


def _die_in_save(engine, step: int) -> None:
    """Make this rank die (SIGKILL) inside the save of `step`, right after writing its tensor file:
    the tag is then never published, whether the save runs in the foreground or in the background."""
    from zero.checkpoint import training

    write = training.save_chunks

    def save_chunks(chunks, path, process_group=None):
        write(chunks, path, process_group=process_group)
        if f".global_step{step}.tmp" in str(path):  # not global_steps: a background save runs while training goes on
            print(f"resume_job: rank {engine.comm.rank} killed while writing {path} at {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    training.save_chunks = save_chunks


if __name__ == "__main__":
    main()
