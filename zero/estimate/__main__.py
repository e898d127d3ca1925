"""`python -m zero.estimate`: per-rank memory of every ZeRO stage and offload option.

    python -m zero.estimate --params 7e9 --gpus 8 --nodes 2
    python -m zero.estimate --model path/to/config.json --gpus 8 --dtype bf16
    python -m zero.estimate --params 1.3e9 --gpus 4 --config ds_config.json
    python -m zero.estimate --params 7e9 --gpus 8 --master-dtype bf16 --state-dtype int8
    python -m zero.estimate --params 7e9 --gpus 8 --stage 3 --state-formats
    python -m zero.estimate --model path/to/config.json --gpus 8 --seq-len 32768 --checkpointing
    python -m zero.estimate --model path/to/config.json --gpus 8 --seq-len 262144 --sequence-parallel 8

The table is in one state format (how the optimizer stores its master weights and Adam's moments):
the config's (`bf16.bf16_master_weights_and_grads`, `bf16.bf16_optimizer_states`,
`optimizer.params.state_dtype`; fp32 master and fp32 moments by default), or the one that
--master-dtype and --state-dtype name. --state-formats adds a state-format column and, under each
option, a line for each common format after that one: for bf16 training fp32 master + fp32
moments, bf16 master + bf16 moments, fp32 master + 8-bit moments and bf16 master + 8-bit moments
(fp16/fp32 training: fp32 master with fp32, bf16 or 8-bit moments). See docs/config.md, "State
formats".

With --model and --seq-len the table gets a peak column: the model states plus one forward and
backward's activations at --micro-batch sequences of --seq-len tokens (zero.estimate_activations
traces the HF model's own code on fake tensors: its attention, --checkpointing, and Ulysses
attention over --sequence-parallel ranks, each holding seq_len / that many tokens).
"""
from __future__ import annotations

import argparse
import sys

from zero.estimate import DTYPES, MASTER_DTYPES, OFFLOADS, STATE_DTYPES, estimate_memory


def _model_from(path: str):
    """A HuggingFace model built from its config on the meta device: parameters counted and units
    planned without allocating them."""
    try:
        import torch
        from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
    except ImportError as err:
        raise SystemExit(f"--model needs transformers (pip install 'zero[hf]'): {err}") from None
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise SystemExit(f"--model {path}: not a HuggingFace config, model directory or hub name here ({err})") from None
    with torch.device("meta"):
        try:
            return AutoModelForCausalLM.from_config(config)
        except ValueError:
            return AutoModel.from_config(config)


def _activations(model, args):
    import torch

    from zero.estimate import estimate_activations

    if args.checkpointing:  # transformers' newer name first
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    model.train()
    return estimate_activations(model, micro_batch_size=args.micro_batch, seq_len=args.seq_len,
                                dtype={"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype],
                                sequence_parallel_size=args.sequence_parallel)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zero.estimate", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 2)[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=float, help="trainable parameters (7e9, 1.3e9, ...)")
    what.add_argument("--model", help="a HuggingFace config.json, model directory or hub name (built on the meta device)")
    parser.add_argument("--gpus", type=int, default=1, help="ranks (GPUs) per node (default 1)")
    parser.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="training dtype (default bf16)")
    parser.add_argument("--stage", type=int, choices=[0, 1, 2, 3], help="only this stage")
    parser.add_argument("--offload", choices=OFFLOADS, help="only this offload option")
    parser.add_argument("--config", help="a DeepSpeed-style config for bucket sizes, stage-3 thresholds, gradient "
                        "accumulation, the communication dtype and the state format")
    parser.add_argument("--master-dtype", choices=list(MASTER_DTYPES), default=None,
                        help="master weights in this format (bf16: --dtype bf16 only; default: the config's, "
                        "else fp32)")
    parser.add_argument("--state-dtype", choices=list(STATE_DTYPES), default=None,
                        help="Adam's moments in this format (int8: 8-bit codes; default: the config's, "
                        "else fp32)")
    parser.add_argument("--state-formats", action="store_true",
                        help="also every common state format: one line per format under each option")
    parser.add_argument("--persistent", type=int, default=None, help="with --params: elements stage 3 keeps whole")
    parser.add_argument("--largest-layer", type=int, default=None,
                        help="with --params: elements of the largest layer (sizes stage 3's buffers)")
    parser.add_argument("--seq-len", type=int, help="with --model: tokens per sequence, for the activations")
    parser.add_argument("--micro-batch", type=int, default=1, help="with --seq-len: sequences per micro-batch")
    parser.add_argument("--checkpointing", action="store_true", help="with --seq-len: gradient checkpointing on")
    parser.add_argument("--sequence-parallel", type=int, default=1,
                        help="with --seq-len: Ulysses sequence parallelism over this many ranks")
    args = parser.parse_args(argv)
    if args.seq_len is not None and not args.model:
        parser.error("--seq-len needs --model (the activations are traced from the model's code)")
    if args.sequence_parallel < 1 or (args.gpus * args.nodes) % args.sequence_parallel:
        parser.error(f"--sequence-parallel {args.sequence_parallel} must divide the {args.gpus * args.nodes} ranks "
                     f"(--gpus x --nodes)")
    for name in ("gpus", "nodes"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    subject = _model_from(args.model) if args.model else args.params
    try:
        activations = None
        if args.seq_len is not None:
            activations = _activations(subject, args)
        table = estimate_memory(subject, args.gpus * args.nodes, stage=args.stage, offload=args.offload,
                                dtype=args.dtype, config=args.config, gpus_per_node=args.gpus,
                                persistent_params=args.persistent, largest_layer=args.largest_layer,
                                master_dtype=args.master_dtype, state_dtype=args.state_dtype,
                                state_formats=args.state_formats, activations=activations)
    except (TypeError, ValueError) as err:
        parser.error(str(err))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
