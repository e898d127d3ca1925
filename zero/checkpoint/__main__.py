"""`python -m zero.checkpoint to-fp32 CKPT_DIR OUT_DIR [--tag T] [--max-shard-size 5GB] [--dtype bf16]`"""
from __future__ import annotations

import argparse
import sys

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zero.checkpoint", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    fp32 = sub.add_parser("to-fp32", help="write a plain (fp32 or bf16) safetensors state dict from a checkpoint")
    fp32.add_argument("checkpoint_dir")
    fp32.add_argument("out_dir")
    fp32.add_argument("--tag", default=None, help="the tag to read (default: the one 'latest' names)")
    fp32.add_argument("--max-shard-size", default="5GB")
    fp32.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    args = parser.parse_args(argv)
    from zero.checkpoint.consolidate import to_fp32
    from zero.checkpoint.training import CheckpointError

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    try:
        files = to_fp32(args.checkpoint_dir, args.out_dir, args.tag, args.max_shard_size, dtype)
    except (CheckpointError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
