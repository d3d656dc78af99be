"""Compare residual merges on your own LightningModule from a script: the README's main job, in Python.

    python examples/compare_residuals.py                       # the built-in GPT, quick default (4 methods, 2 seeds)
    python examples/compare_residuals.py my_pkg.MyModule my_pkg.MyDataModule

The same job as ``lightning-resctl compare``; :func:`lightning_resctl.compare` returns the summary table and writes
``summary.md``, plots and TensorBoard logs into ``out``.
"""
import importlib
import sys

import lightning_resctl


def _load(path: str):
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


if __name__ == "__main__":
    model = _load(sys.argv[1]) if len(sys.argv) > 1 else None          # a class: built once per seed
    data = _load(sys.argv[2]) if len(sys.argv) > 2 else None
    table = lightning_resctl.compare(model=model, datamodule=data,
                                     methods=["plain", "rescontroller", "mgr-independent", "mgr-competitive"],
                                     seeds=2, trainer={"max_steps": 160, "val_check_interval": 10,
                                                       "check_val_every_n_epoch": None, "gradient_clip_val": 1.0},
                                     out="resctl_runs/example")
    print(table)
