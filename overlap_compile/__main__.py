"""Command line: ``python -m overlap_compile {demo,profile}``."""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"demo": "overlap_compile.demo.run", "profile": "overlap_compile.profiling.command"}
    if not argv or argv[0] not in commands:
        print("usage: python -m overlap_compile {demo,profile} [options]\n"
              "  demo     run the main job on whatever this machine has (GPUs, else CPU processes over gloo)\n"
              "  profile  measure this cluster's hardware profile (run under torchrun on GPUs)", file=sys.stderr)
        return 2
    import importlib

    return importlib.import_module(commands[argv[0]]).main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
