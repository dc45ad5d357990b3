"""Run a Python module (as `python -m`) with every thread's Python stack written to a file at a fixed interval: where
a call that does not end (a GPU kernel that never finishes, a compiler pass that runs for minutes) is stuck. The
dumps come from faulthandler's watchdog thread, so they are written even while the main thread sits in C code and
ignores SIGINT.

    python3 scripts/with_stack_dumps.py --every 20 --file $OUT/stacks.txt -- fa_backend bench --dims 256 ...
"""

from __future__ import annotations

import argparse
import faulthandler
import runpy
import sys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=float, default=30.0, help="seconds between dumps")
    parser.add_argument("--file", required=True, help="the dumps are appended here")
    parser.add_argument("module", help="the module to run, then its arguments (after --)")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    with open(args.file, "a") as out:
        faulthandler.dump_traceback_later(args.every, repeat=True, file=out)
        sys.argv = [args.module, *args.args]
        try:
            runpy.run_module(args.module, run_name="__main__", alter_sys=True)
        finally:
            faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main()
