"""The ``compare`` command line: flags, ``--config FILE.yaml``, ``--preset``, and :func:`main`."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from .config import CompareConfig
from .methods import PRESETS, UnknownMethodError, available_methods, check_methods

__all__ = ["build_parser", "parse_config", "main", "HelpFormatter"]

PROG = "python -m lightning_resctl compare"
_ALIASES = {"depth": "n_layer", "width": "n_embd", "heads": "n_head", "device": "accelerator", "output_dir": "out"}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """``--help`` shows the default of every option, including options without a help text."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is argparse.SUPPRESS or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            return text
        if "%(default)" in text or "(default:" in text:
            return text
        default = action.default
        if isinstance(default, (list, tuple)):
            shown = ",".join(map(str, default))
        else:
            shown = "%(default)s"
        return (text + " " if text else "") + f"(default: {shown})"


def _bool(text: str) -> bool:
    lowered = str(text).lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {text!r}")


def _methods(text: str) -> list[str]:
    names = [m.strip() for m in str(text).split(",") if m.strip()]
    try:
        return check_methods(names)
    except UnknownMethodError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _version() -> str:
    from .. import __version__

    return f"lightning_resctl {__version__}"


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The ``compare`` flags. Every flag is also a YAML key of ``--config`` (flags win)."""
    d = CompareConfig()
    p = argparse.ArgumentParser(
        prog=prog, formatter_class=HelpFormatter, usage="%(prog)s [flags]  (--help: every flag and its default)",
        description="Train the same char-level GPT with each residual merge (same seeds, data order, "
                    "optimizer, steps), measure each method's training-step cost next to plain's, and write "
                    "summary.md, PNG plots and TensorBoard logs into --out.",
        epilog="examples:\n"
               f"  {prog}                                  # the quick default (about 10-15 min on 2 CPU cores)\n"
               f"  {prog} --preset paper --steps 1000 --seeds 3\n"
               f"  {prog} --methods plain,mgr-competitive --config my.yaml --out runs/x --overwrite")
    p.add_argument("--version", action="version", version=_version())
    p.add_argument("--config", metavar="FILE.yaml", help="YAML file of options (keys as the flags, "
                   "dashes or underscores); flags given on the command line override it")
    g = p.add_argument_group("model")
    g.add_argument("--n-layer", "--depth", dest="n_layer", type=int, default=d.n_layer,
                   help="transformer blocks (2 residual merges each)")
    g.add_argument("--n-embd", "--width", dest="n_embd", type=int, default=d.n_embd, help="width C")
    g.add_argument("--n-head", "--heads", dest="n_head", type=int, default=d.n_head, help="attention heads")
    g.add_argument("--block-size", dest="block_size", type=int, default=d.block_size, help="context length")
    g.add_argument("--dropout", type=float, default=d.dropout, help="dropout probability")
    g = p.add_argument_group("methods and seeds")
    g.add_argument("--methods", type=_methods, default=None,
                   help="comma-separated: plain (the model unpatched) or any registered merge rule: "
                        f"{', '.join(available_methods()[1:])} (default: {','.join(d.methods)})")
    g.add_argument("--preset", choices=sorted(PRESETS), default=d.preset,
                   help="a named method set instead of --methods: "
                        + "; ".join(f"{k} = {','.join(v)}" for k, v in PRESETS.items()))
    g.add_argument("--seeds", type=int, default=d.seeds, help="number of seeds; every method runs on each")
    g.add_argument("--first-seed", dest="first_seed", type=int, default=d.first_seed, help="first seed")
    g.add_argument("--streams", type=int, default=d.streams,
                   help="n, for every rule with a `streams` option (MGR, HC, ...)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, default=d.steps, help="training steps per run")
    g.add_argument("--batch-size", dest="batch_size", type=int, default=d.batch_size, help="sequences per step")
    g.add_argument("--lr", type=float, default=d.lr, help="AdamW peak learning rate")
    g.add_argument("--weight-decay", dest="weight_decay", type=float, default=d.weight_decay,
                   help="AdamW weight decay (matrices only)")
    g.add_argument("--warmup-steps", dest="warmup_steps", type=int, default=d.warmup_steps,
                   help="linear warm-up before the cosine decay")
    g.add_argument("--grad-clip", dest="grad_clip", type=float, default=d.grad_clip, help="gradient norm clip")
    g = p.add_argument_group("evaluation and logging")
    g.add_argument("--eval-every", dest="eval_every", type=int, default=d.eval_every,
                   help="validate every N steps")
    g.add_argument("--val-batches", dest="val_batches", type=int, default=d.val_batches,
                   help="batches per validation (the same windows for every method and seed)")
    g.add_argument("--ablation", type=_bool, default=d.ablation, metavar="BOOL",
                   help="run ResidualAblationCallback once at the end (loss increase per skipped merge)")
    g.add_argument("--ablation-batches", dest="ablation_batches", type=int, default=d.ablation_batches,
                   help="validation batches per ablated merge")
    g.add_argument("--log-every-n-steps", dest="log_every_n_steps", type=int, default=d.log_every_n_steps,
                   help="TensorBoard logging interval of the diagnostics")
    g.add_argument("--depth-images", dest="depth_images", type=_bool, default=d.depth_images, metavar="BOOL",
                   help="TensorBoard depth-profile images at every validation")
    g.add_argument("--cost-steps", dest="cost_steps", type=int, default=d.cost_steps,
                   help="timed rounds of the cost-vs-plain measurement (one interleaved training step per "
                        "method per round; 0 = skip)")
    g.add_argument("--cost-warmup", dest="cost_warmup", type=int, default=d.cost_warmup,
                   help="untimed rounds before them")
    g = p.add_argument_group("hardware")
    g.add_argument("--accelerator", "--device", dest="accelerator", default=d.accelerator,
                   help="Lightning accelerator: auto, cpu, gpu, cuda, mps")
    g.add_argument("--precision", default=d.precision, help="Lightning precision, e.g. 32-true, bf16-mixed")
    g.add_argument("--threads", type=int, default=d.threads, help="torch.set_num_threads (CPU); None = torch's")
    g = p.add_argument_group("data")
    g.add_argument("--text", default=d.text, metavar="PATH",
                   help="your own text file or folder instead of the standard-library sources")
    g.add_argument("--hf-dataset", dest="hf_dataset", default=d.hf_dataset, metavar="NAME",
                   help="a Hugging Face dataset name (needs `datasets` and network)")
    g.add_argument("--hf-config", dest="hf_config", default=d.hf_config, help="its configuration name")
    g.add_argument("--hf-text-field", dest="hf_text_field", default=d.hf_text_field, help="its text column")
    g.add_argument("--max-train-chars", dest="max_train_chars", type=int, default=d.max_train_chars,
                   help="cap on training characters")
    g.add_argument("--max-val-chars", dest="max_val_chars", type=int, default=d.max_val_chars,
                   help="cap on validation characters")
    g = p.add_argument_group("output")
    g.add_argument("--out", "--output-dir", dest="out", default=d.out, help="output folder")
    g.add_argument("--overwrite", action="store_true", default=d.overwrite,
                   help="replace the results of an earlier job in --out (without it, such a folder is an error)")
    g.add_argument("--progress-bar", dest="progress_bar", type=_bool, default=d.progress_bar, metavar="BOOL",
                   help="one progress line for the whole job (run, method, seed, step, ETA)")
    return p


def _yaml_defaults(path: str) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except FileNotFoundError:
        raise SystemExit(f"--config: no such file: {path!r}") from None
    if not isinstance(data, dict):
        raise SystemExit(f"--config {path}: expected a mapping of option: value, got {type(data).__name__}")
    valid = {f.name for f in fields(CompareConfig)}
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        name = _ALIASES.get(name, name)
        if name not in valid:
            raise SystemExit(f"--config {path}: unknown option {key!r}; valid: {sorted(valid)}")
        if name == "methods" and isinstance(value, str):
            value = [m.strip() for m in value.split(",") if m.strip()]
        out[name] = value
    return out


def parse_config(argv: Sequence[str] | None = None) -> CompareConfig:
    """Flags -> :class:`CompareConfig`; ``--config FILE.yaml`` supplies defaults that flags override.

    ``--preset NAME`` selects its method set unless methods are given too (by flag or YAML)."""
    parser = build_parser()
    pre, _ = parser.parse_known_args(argv)
    if pre.config:
        parser.set_defaults(**_yaml_defaults(pre.config))
    args = vars(parser.parse_args(argv))
    args.pop("config", None)
    if args.get("methods") is None:
        args["methods"] = list(PRESETS[args["preset"]]) if args.get("preset") else list(CompareConfig().methods)
    cfg = CompareConfig(**args)
    try:
        return cfg.validate()
    except ValueError as err:
        parser.error(str(err))
        raise  # unreachable


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m lightning_resctl compare [flags]``."""
    from .. import compare  # the package attribute, so that tests and wrappers can replace it
    from .runs import OutputExistsError

    cfg = parse_config(argv)
    try:
        compare.run_comparison(cfg)
    except OutputExistsError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    return 0
