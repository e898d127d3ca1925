"""`python -m zero.ops build`: compile every native op this machine can build, now."""
from __future__ import annotations

import argparse
import sys

from zero.ops import builder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zero.ops", description=__doc__)
    parser.add_argument("command", choices=["build"], help="build: compile every op buildable here")
    parser.add_argument("ops", nargs="*", help="only these ops (default: all)")
    args = parser.parse_args(argv)
    failed = 0
    for name in args.ops or list(builder.OPS):
        if name not in builder.OPS:
            print(f"{name}: unknown op (known: {', '.join(builder.OPS)})")
            failed += 1
            continue
        reason = builder.missing(name)
        if reason is not None:
            print(f"{name}: skipped, {reason}")
            continue
        try:
            builder.load(name)
            print(f"{name}: built in {builder.build_dir(name)}")
        except builder.OpUnavailable as exc:
            print(f"{name}: FAILED\n{exc}")
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
