"""Command line: ``python -m lightning_resctl compare [flags]`` (also the ``lightning-resctl`` script).

Sub-commands:

* ``compare`` — the main job (:mod:`lightning_resctl.compare`): train the same char-level GPT with
  each residual merge and write ``summary.md``, PNG plots and TensorBoard logs.
  ``python -m lightning_resctl compare --help`` lists its flags.

With no sub-command, ``compare`` runs with its defaults.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence

_COMMANDS = ("compare",)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    command = "compare"
    if args and not args[0].startswith("-"):
        command = args.pop(0)
    if command not in _COMMANDS:
        print(f"lightning-resctl: unknown command {command!r}; choose from {', '.join(_COMMANDS)}",
              file=sys.stderr)
        return 2
    from .compare import main as compare_main

    return compare_main(args)


if __name__ == "__main__":
    sys.exit(main())
