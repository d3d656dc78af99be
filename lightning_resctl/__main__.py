"""Command line of lightning_resctl (also installed as the ``lightning-resctl`` script).

usage: {prog} [-h] [--version] COMMAND [flags]

commands:
  compare    the main job: train your LightningModule (default: the built-in byte-level GPT) with plain
             residuals and with each merge rule — same initial weights, data order, optimizer and Trainer
             settings per seed — compare the monitored validation metric seed by seed, check each method's
             start against plain, measure its training-step cost next to plain's, and write summary.md,
             PNG plots and TensorBoard logs. Built on LightningCLI: --model, --data, --trainer.*,
             --config my.yaml, --print_config. `{prog} compare --help` lists every option;
             `{prog} compare` runs the quick default (about 12 minutes on 2 CPU cores).
  summarize  merge the output folders of one compare job (e.g. its shards): summarize OUT [OUT ...]

options:
  -h, --help  show this help and exit
  --version   print the version, and the installed and tested versions of torch, lightning,
              transformers and triton, and exit
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from importlib.resources import files

from .compare.program import program_name

_COMMANDS = ("compare", "summarize")

#: The distributions ``--version`` names, installed beside tested.
STACK = ("torch", "lightning", "transformers", "triton")


def tested_versions() -> dict[str, str]:
    """The versions the whole test suite last passed with: ``lightning_resctl/tested_versions.txt``, a pip
    constraints file (``pip install -c``; README, docs/install.md), one ``name==version`` a line."""
    text = files(__package__).joinpath("tested_versions.txt").read_text()
    pins = (line.split("#", 1)[0].strip() for line in text.splitlines())
    return {name.strip().lower(): pinned.strip() for name, pinned in (p.split("==", 1) for p in pins if p)}


#: The versions of the stack the test suite last passed with (torch's CPU build, triton's CPU interpreter), read
#: from the constraints file, where they are written once.
TESTED_WITH = {dist: tested_versions()[dist] for dist in STACK}


def _installed(dist: str) -> str:
    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def stack_versions() -> list[str]:
    """One line per distribution of :data:`TESTED_WITH`: ``torch 2.13.0+cpu (tested: 2.13.0)``."""
    width = max(map(len, TESTED_WITH))
    return [f"{dist:<{width}} {_installed(dist)} (tested: {tested})" for dist, tested in TESTED_WITH.items()]


def _help() -> str:
    return __doc__.split("\n\n", 1)[1].strip().format(prog=program_name())


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        # a bare command prints this help: it never starts a job by itself
        print(_help())
        return 0
    if args[0] == "--version":
        from . import __version__

        print("\n".join([f"lightning_resctl {__version__}", *stack_versions()]))
        return 0
    command = args.pop(0)
    if command not in _COMMANDS:
        print(f"lightning-resctl: unknown command {command!r}; choose from {', '.join(_COMMANDS)} "
              f"({program_name()} --help)", file=sys.stderr)
        return 2
    from .compare import cli

    return cli.main(args) if command == "compare" else cli.summarize_main(args)


if __name__ == "__main__":
    sys.exit(main())
