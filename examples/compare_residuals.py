"""Compare residual merges on your own LightningModule from a script: the README's main job, in Python.

    python examples/compare_residuals.py                       # the built-in GPT, quick default (4 methods, 2 seeds)
    python examples/compare_residuals.py my_pkg.MyModule my_pkg.MyDataModule
    python examples/compare_residuals.py --help

The same job as ``lightning-resctl compare``; :func:`lightning_resctl.compare` returns the summary table and writes
``summary.md``, plots and TensorBoard logs into ``out``.
"""
import argparse
import importlib

import lightning_resctl


def import_path(path: str):
    """The object named by ``pkg.module.Name`` (an argparse type: a bad path is an argument error)."""
    module, _, name = path.rpartition(".")
    if not module or not name:
        raise argparse.ArgumentTypeError(f"expected an import path like my_pkg.MyModule, got {path!r}")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise argparse.ArgumentTypeError(f"cannot import {path!r}: {err}") from None


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", type=import_path, default=None,
                        help="LightningModule class, built once per seed (default: the built-in byte-level GPT)")
    parser.add_argument("data", nargs="?", type=import_path, default=None,
                        help="LightningDataModule class (default: the built-in corpus with the built-in model, "
                             "else the model's own dataloaders)")
    parser.add_argument("--seeds", type=positive_int, default=2, help="number of seeds (default: 2)")
    parser.add_argument("--max_steps", type=positive_int, default=160, help="training steps per run (default: 160)")
    parser.add_argument("--out", default="resctl_runs/example", help="output folder (default: resctl_runs/example)")
    args = parser.parse_args(argv)
    table = lightning_resctl.compare(model=args.model, datamodule=args.data,
                                     methods=["plain", "rescontroller", "mgr-independent", "mgr-competitive"],
                                     seeds=args.seeds, trainer={"max_steps": args.max_steps, "val_check_interval": 10,
                                                                "check_val_every_n_epoch": None,
                                                                "gradient_clip_val": 1.0},
                                     out=args.out)
    print(table)


if __name__ == "__main__":
    main()
