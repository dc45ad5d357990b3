"""Command line: python -m fa_backend {demo,bench}."""

from __future__ import annotations

import sys

COMMANDS = {
    "demo": ("fa_backend.demo", "a small GPT routed through fa_backend, with a routing report (--kernels: "
                                "the kernels next to PyTorch)"),
    "doctor": ("fa_backend.doctor", "hardware, software, backends, a tiny check of each kernel, routing status"),
    "bench": ("fa_backend.bench", "GPU: TFLOP/s against PyTorch's SDPA backends"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print("usage: python -m fa_backend {" + ",".join(COMMANDS) + "} [options]\n")
        for name, (_, text) in COMMANDS.items():
            print(f"  {name:8} {text}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    import importlib

    return importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
