"""The command line: ``lightning-resctl compare`` (built on LightningCLI) and ``lightning-resctl summarize``.

``compare`` reads what the user's own LightningCLI reads — ``--model``, ``--data``, ``--trainer.*`` with
``class_path`` / ``init_args``, or ``--config my.yaml`` with ``model:``, ``data:``, ``trainer:`` — plus the job's
own options (:class:`~lightning_resctl.compare.options.CompareOptions`) as ``--methods`` / ``--compare.methods``
flags or a ``compare:`` section; ``--print_config`` prints the whole configuration. Without ``--model`` the
built-in byte-level GPT and its standard-library corpus are compared, with :data:`TRAINER_DEFAULTS`.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import textwrap
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional, Union

from jsonargparse import DefaultHelpFormatter
from lightning import LightningModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from . import job
from .methods import PRESETS, available_methods
from .options import HELP, CompareOptions
from .preemption import JobStopped
from .program import program_name

__all__ = ["CompareCLI", "main", "summarize_main", "resume_command", "TRAINER_DEFAULTS"]

#: Trainer settings of the command line unless given (the quick default of the built-in model: 100 steps,
#: validation every 10 steps on 3 batches, one device).
TRAINER_DEFAULTS = {"max_steps": 100, "val_check_interval": 10, "check_val_every_n_epoch": None,
                    "log_every_n_steps": 20, "gradient_clip_val": 1.0, "devices": 1, "num_sanity_val_steps": 0,
                    "enable_model_summary": False}
DEFAULT_MODEL = "lightning_resctl.compare.gpt.CharGPT"
DEFAULT_DATA = "lightning_resctl.compare.data.CharDataModule"

_USAGE = ("{prog} [--model CLASS] [--data CLASS] [--config YAML] [--methods M1,M2,...] [--preset NAME]\n"
          "       [--seeds N] [--out DIR] [--trainer.FLAG VALUE ...] [--model.ARG VALUE ...] [--print_config]")


def _description(prog: str) -> str:
    """What ``--help`` prints before the options: what the job does, examples, the method names, what follows."""
    what = textwrap.fill(
        "Train your LightningModule (default: the built-in byte-level GPT) with plain residuals and with each merge "
        "rule: same initial weights, data order, optimizer and Trainer settings per seed. Compare the monitored "
        "validation metric seed by seed, check how far each method starts from plain, measure each method's "
        "training step next to plain's, and write summary.md, PNG plots and TensorBoard logs into --out. "
        "model/data/trainer take the same arguments and YAML (class_path / init_args) as your own LightningCLI.")
    presets = "; ".join(f"{k} = {','.join(v)}" for k, v in PRESETS.items())
    return f"""{what}

examples:
  {prog}                                   # the quick default: built-in GPT, 4 methods, 2 seeds
  {prog} --model my_pkg.MyModule --data my_pkg.MyDataModule --trainer.max_steps 2000 \\
      --methods plain,mgr-competitive,rescontroller --seeds 3
  {prog} --config my.yaml                  # model:, data:, trainer: and a compare: section
  {prog} --config my.yaml --print_config   # the whole configuration, defaults included
  {prog} --preset paper --seeds 3 --model.n_layer 8 --trainer.max_steps 200
  {prog} --config my.yaml --resume         # continue a killed job
  {prog} --config my.yaml --shard 1/2 --out runs/s1   # then: lightning-resctl summarize runs/s1 runs/s2

method names: {', '.join(available_methods())}
presets: {presets}

Below: the compare options (also a compare: section of --config), then --trainer.* (Lightning's Trainer
arguments), --model.* and --data.* (your classes' __init__ arguments)."""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, DefaultHelpFormatter):
    """jsonargparse's help, with the description and the examples printed as written."""


def _methods(value: Any) -> list[str]:
    """A list of method names, from a list or a comma-separated string."""
    if isinstance(value, str):
        return [m.strip() for m in value.split(",") if m.strip()]
    return [str(m) for m in value]


def _configs(args: Sequence[str]) -> list[dict]:
    """The mappings of the ``--config`` files ``args`` name (those that cannot be read are the parser's to report)."""
    import yaml

    found = []
    for i, arg in enumerate(args):
        path = args[i + 1] if arg in ("-c", "--config") and i + 1 < len(args) else (
            arg.split("=", 1)[1] if arg.startswith("--config=") else None)
        if path is not None and Path(path).is_file():
            try:
                loaded = yaml.safe_load(Path(path).read_text())
            except yaml.YAMLError:
                continue
            if isinstance(loaded, dict):
                found.append(loaded)
    return found


def _given(args: Sequence[str], key: str) -> bool:
    """Whether ``args`` choose a class for ``key`` (``--model CLASS``, ``--model=CLASS``, or a ``--config`` file with
    a ``model:`` entry)."""
    if any(arg == f"--{key}" or arg.startswith(f"--{key}=") for arg in args):
        return True
    return any(config.get(key) is not None for config in _configs(args))


def _trainer_keys_given(args: Sequence[str]) -> set[str]:
    """The Trainer arguments ``args`` set: ``--trainer.KEY`` flags and the ``trainer:`` sections of config files."""
    keys = {arg[len("--trainer."):].split("=", 1)[0] for arg in args if arg.startswith("--trainer.")}
    for config in _configs(args):
        if isinstance(config.get("trainer"), dict):
            keys.update(config["trainer"])
    return {key.split(".", 1)[0].rstrip("+") for key in keys}


class CompareCLI(LightningCLI):
    """LightningCLI of the compare job: ``model``, ``data`` and ``trainer`` as in any LightningCLI (subclass mode, so
    ``--model my_pkg.MyModule``), and a ``compare`` group (every field of :class:`CompareOptions`, also as a
    top-level flag: ``--methods`` = ``--compare.methods``). Nothing is instantiated on parsing: the job builds the
    model once per seed and the data and Trainer once per run (:meth:`job_inputs`)."""

    def __init__(self, args: Sequence[str] | None = None):
        super().__init__(
            model_class=LightningModule, datamodule_class=None, subclass_mode_model=True,
            subclass_mode_data=True, trainer_defaults=TRAINER_DEFAULTS, seed_everything_default=False,
            save_config_callback=None, auto_configure_optimizers=False, run=False, args=args,
            parser_kwargs={"prog": _program(), "usage": _USAGE.format(prog=_program()),
                           "description": _description(_program()), "default_env": False,
                           "formatter_class": _HelpFormatter})

    # ------------------------------------------------------------------ parser
    def add_default_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """No ``--seed_everything``: the job seeds every run itself (``--seeds``, ``--first_seed``)."""

    def _set_seed(self) -> None:
        """The job seeds each run; nothing is seeded on parsing."""

    def parse_arguments(self, parser: LightningArgumentParser, args) -> None:
        """Parse ``args`` (``sys.argv[1:]`` when None). Without a model class (``--model CLASS`` or ``model:`` in a
        config file) the built-in model is compared, on the built-in data unless ``--data`` / ``data:`` is given;
        with a model class and no data class the model's own dataloaders are used. (Defaults are prepended rather
        than set in the parser: jsonargparse keeps a default class's init args that a new class also accepts, which
        would hand the built-in model's ``lr`` or ``dropout`` to the user's model.)"""
        args = list(sys.argv[1:] if args is None else args)
        self.trainer_chosen = {k: v for k, v in TRAINER_DEFAULTS.items() if k not in _trainer_keys_given(args)}
        if not _given(args, "model"):
            args = ["--model", DEFAULT_MODEL, *([] if _given(args, "data") else ["--data", DEFAULT_DATA]), *args]
        self.config = parser.parse_args(args)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        hints = typing.get_type_hints(CompareOptions)
        defaults = CompareOptions()
        for field in CompareOptions.__dataclass_fields__.values():
            # methods: a list, or a comma-separated string (split in compare_options)
            kind = Optional[Union[list[str], str]] if field.name == "methods" else hints[field.name]
            default = getattr(defaults, field.name)
            flag = {"nargs": "?", "const": True} if kind is bool else {}  # `--resume` = `--resume true`
            parser.add_argument(f"--compare.{field.name}", f"--{field.name}", type=kind, default=default,
                                help=HELP[field.name], **flag)

    def instantiate_classes(self) -> None:
        """Nothing is built on parsing (see the class docstring)."""

    # ------------------------------------------------------------------ what the job needs
    def compare_options(self) -> CompareOptions:
        """The ``compare`` group as validated :class:`CompareOptions` (a bad value exits with the parser's error)."""
        values = dict(self.config.compare)
        if values.get("methods") is not None:
            values["methods"] = _methods(values["methods"])
        try:
            return CompareOptions(**values).validate()
        except ValueError as err:
            self.parser.error(str(err))
            raise  # unreachable: error() exits

    def _instantiate(self, key: str) -> Any:
        instantiate = getattr(self.parser, "instantiate", None) or self.parser.instantiate_classes
        sub = type(self.config)(**{key: self.config[key].clone() if self.config[key] is not None else None})
        return instantiate(sub)[key]

    def job_inputs(self) -> job.JobInputs:
        """How the job builds the model (once per seed), the data and the Trainer arguments (once per run)."""
        dumped = json.loads(self.parser.dump(self.config, format="json", skip_none=False))

        def trainer_kwargs() -> dict[str, Any]:
            return dict(self._instantiate("trainer"))

        def datamodule():
            return self._instantiate("data") if self.config.get("data") is not None else None

        identity = {key: dumped.get(key) for key in ("model", "data", "trainer")}
        return job.JobInputs(lambda: self._instantiate("model"), datamodule, trainer_kwargs, identity,
                             trainer_chosen=self.trainer_chosen)


def main(argv: Sequence[str] | None = None) -> int:
    """``lightning-resctl compare [flags]`` (``python -m lightning_resctl compare``): returns the exit status."""
    from .records import JobMismatchError, OutputExistsError

    args = list(sys.argv[1:] if argv is None else argv)
    cli = CompareCLI(args)
    opts = cli.compare_options()
    inputs = cli.job_inputs()
    inputs.resume = resume_command(args, opts)
    try:
        job.run_job(inputs, opts)
    except (OutputExistsError, JobMismatchError) as err:
        print(f"{_program()}: error: {err}", file=sys.stderr)
        return 2
    except JobStopped as stopped:
        return stopped.code
    return 0


def _program() -> str:
    """How this process was started: ``python -m lightning_resctl compare``, ``python -m lightning_resctl.compare``
    or (the installed script, and the default) ``lightning-resctl compare``."""
    main_file = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if main_file is not None and main_file.name == "__main__.py" and main_file.parent.name == "compare":
        return "python -m lightning_resctl.compare"
    return f"{program_name()} compare"


def resume_command(args: Sequence[str], opts: CompareOptions) -> str:
    """The command that resumes the job started with ``args`` (parsed to ``opts``): the same flags, then
    ``--overwrite false`` when the job overwrote (it would delete what is resumed) and ``--resume``."""
    tail = (["--overwrite", "false"] if opts.overwrite else []) + ([] if opts.resume else ["--resume"])
    return f"{_program()} {shlex.join([*args, *tail])}".strip()


def summarize_main(argv: Sequence[str] | None = None) -> int:
    """``lightning-resctl summarize OUT [OUT ...] [--out DIR]``: merge one job's folders (e.g. its shards)."""
    from jsonargparse import ArgumentParser

    from .api import summarize
    from .records import JobMismatchError

    parser = ArgumentParser(prog="lightning-resctl summarize", default_env=False,
                            description="Merge the run records of one compare job's output folders (e.g. the "
                                        "folders of its shards) into one summary.md / summary.json / plots.")
    parser.add_argument("folders", nargs="+", help="output folders of the same job")
    parser.add_argument("--out", default=None, help="where to write the summary (default: the first folder)")
    args = parser.parse_args(list(argv) if argv is not None else None)
    try:
        table = summarize(*args.folders, out=args.out)
    except (FileNotFoundError, JobMismatchError) as err:
        print(f"lightning-resctl summarize: error: {err}", file=sys.stderr)
        return 2
    print(table.to_markdown())
    print(f"[resctl] summary: {table.path / 'summary.md'}")
    return 0
