"""`python -m zero.ops build`: compile every native op this machine can build, now, and say how
long each took (`make demo` and `make test` run it first, so a first run's build shows once)."""
from __future__ import annotations

import argparse
import sys
import time

from zero.ops import builder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zero.ops", description=__doc__)
    parser.add_argument("command", choices=["build"], help="build: compile every op buildable here")
    parser.add_argument("ops", nargs="*", help="only these ops (default: all)")
    args = parser.parse_args(argv)
    try:
        jobs = builder.build_jobs()
    except ValueError as exc:
        print(exc)
        return 2
    failed = 0
    start = time.monotonic()
    for name in args.ops or list(builder.OPS):
        if name not in builder.OPS:
            print(f"{name}: unknown op (known: {', '.join(builder.OPS)})")
            failed += 1
            continue
        reason = builder.missing(name)
        if reason is not None:
            print(f"{name}: skipped, {reason}")
            continue
        cached = builder.is_built(name)
        began = time.monotonic()
        try:
            builder.load(name)
        except builder.OpUnavailable as exc:
            print(f"{name}: FAILED\n{exc}")
            failed += 1
            continue
        how = "already built" if cached else f"built in {time.monotonic() - began:.1f} s"
        print(f"{name}: {how} ({builder.build_dir(name)})", flush=True)
    print(f"native ops: {time.monotonic() - start:.1f} s in all, {jobs} compiler jobs at a time; "
          f"cache {builder.cache_dir()}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
