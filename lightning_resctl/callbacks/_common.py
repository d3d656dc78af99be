"""Shared plumbing of the diagnostics callbacks: finding/patching merge sites, tags, logger output."""
from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from .._logging import rank_zero_line  # noqa: F401 - used by the callbacks as C.rank_zero_line


def check_method(method: Any, options: Mapping[str, Any] | None = None) -> str | None:
    """``method`` must be None or a registered merge rule, and ``options`` valid options of it: checked when a
    callback is constructed, not inside ``fit``."""
    if method is None:
        if options:
            raise ValueError(f"method options {sorted(options)} given without a method (method=None)")
        return None
    from lightning_resctl.rules import get_merge_rule, make_rule

    try:
        get_merge_rule(method)
    except (TypeError, ValueError) as err:
        raise ValueError(f"method must be None or a registered merge rule: {err}") from None
    make_rule(method, dict(options or {}))
    return method


def _surgery():
    from lightning_resctl import surgery

    return surgery


def _has_dtensor_params(module: nn.Module) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return any(isinstance(p, DTensor) for p in module.parameters())


def ensure_patched(
    module: nn.Module,
    method: str | None,
    *,
    example_input: Any = None,
    include: Any = None,
    exclude: Any = None,
    method_options: Mapping[str, Any] | None = None,
    example_from: Any = None,
) -> bool:
    """Patch ``module`` with ``method`` unless it already is; ``method=None`` patches with ``"add"``
    (plain additions, outputs bitwise unchanged) just to find the merges.

    Returns True when this call patched the module (a module holding merge sites already, itself or in a
    submodule, is left as is). ``example_from``: a module whose ``example_input_array`` serves as the
    example input when neither ``example_input`` nor ``module.example_input_array`` is set. A module patched already with another method
    raises ValueError; MGR on an already sharded (FSDP2/DTensor) module raises RuntimeError, since its
    new parameters would not be sharded (patch inside ``configure_model`` before ``fully_shard``,
    see :func:`lightning_resctl.callbacks.patch_in_configure_model`).
    """
    surgery = _surgery()
    sites = surgery.merge_sites(module)  # also finds a patch applied to a submodule (e.g. self.model)
    if sites or surgery.get_patch_report(module) is not None:
        if method is not None:
            have = {getattr(s, "method", None) for s in sites}
            if have and have != {method}:
                raise ValueError(
                    f"the model is already patched with method {sorted(have)}, but the callback was given "
                    f"method={method!r}; pass method=None to only observe, or unpatch first"
                )
        return False
    use = method or "add"
    from lightning_resctl.rules import make_rule

    rule = make_rule(use, dict(method_options or {}))
    if rule.kind == "chain" and _has_dtensor_params(module):
        raise RuntimeError(
            f"the model's parameters are already sharded (DTensor) when the residual patch runs, so {use}'s new "
            "parameters would not be sharded. Call `lightning_resctl.callbacks.patch_in_configure_model(self)` "
            "in configure_model after building the layers and before fully_shard."
        )
    kwargs: dict[str, Any] = dict(method_options or {})
    if example_input is None and example_from is not None and not hasattr(module, "example_input_array"):
        example_input = getattr(example_from, "example_input_array", None)
    if example_input is not None:
        kwargs["example_input"] = example_input
    if include is not None:
        kwargs["include"] = include
    if exclude is not None:
        kwargs["exclude"] = exclude
    surgery.patch_residuals(module, method=use, **kwargs)
    return True


def patch_copies(trainer: Any, pl_module: nn.Module, method: str | None, **kwargs: Any) -> None:
    """Patch deep copies of ``pl_module`` held by other callbacks (e.g. StochasticWeightAveraging's average
    model, copied in its ``setup`` before this callback ran) the same way, and give them the patched weights."""
    surgery = _surgery()
    for cb in getattr(trainer, "callbacks", []):
        for name, value in list(vars(cb).items()):
            if (
                isinstance(value, nn.Module)
                and value is not pl_module
                and type(value) is type(pl_module)
                and surgery.get_patch_report(value) is None
            ):
                try:
                    ensure_patched(value, method, **kwargs)
                    value.load_state_dict(pl_module.state_dict())
                except Exception as err:  # noqa: BLE001 - a copy we cannot patch must not stop training
                    warnings.warn(
                        f"could not patch {type(cb).__name__}.{name} (a copy of the model) like the model: {err}",
                        stacklevel=2,
                    )


def depth_tag(index: int, num: int) -> str:
    """Zero-padded depth label: 2 digits, more when there are 100+ merges."""
    return f"{index:0{max(2, len(str(num - 1)))}d}"


def check_per_depth(per_depth: Any) -> Any:
    """``"few"``, ``"all"`` or a non-empty list of depth indices (ints >= 0)."""
    if per_depth in ("few", "all"):
        return per_depth
    if isinstance(per_depth, (list, tuple)) and per_depth and all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in per_depth
    ):
        return sorted(set(per_depth))
    raise ValueError(f"per_depth must be 'few', 'all' or a list of depth indices, got {per_depth!r}")


def chosen_depths(per_depth: Any, num_depths: int) -> list[int]:
    """The depths that get per-depth scalars: all, first/middle/last ("few"), or the listed ones that exist."""
    if per_depth == "all":
        return list(range(num_depths))
    if per_depth == "few":
        return sorted({0, num_depths // 2, num_depths - 1})
    return [d for d in per_depth if d < num_depths]


def scalar_tags(prefix: str, values: Mapping[str, torch.Tensor], num_depths: int,
                depths: list[int] | None = None) -> dict[str, float]:
    """``{family: (D,) or (D, n)}`` -> ``{f"{prefix}/{family}/{dd}": v}`` for ``depths`` (default: all);
    per-stream families get ``_s{i}`` appended to the family name; NaN entries (nothing observed) are dropped."""
    keep = range(num_depths) if depths is None else depths
    out: dict[str, float] = {}
    for family, t in values.items():
        t = t.detach().double().cpu()
        for d in keep:
            if t.dim() == 1:
                v = float(t[d])
                if v == v:
                    out[f"{prefix}/{family}/{depth_tag(d, num_depths)}"] = v
            else:
                for i, v in enumerate(t[d].tolist()):
                    if v == v:
                        out[f"{prefix}/{family}_s{i}/{depth_tag(d, num_depths)}"] = float(v)
    return out


def families_of(tags: Mapping[str, float], prefix: str) -> list[str]:
    fams = []
    for tag in tags:
        fam = tag[len(prefix) + 1 :].rsplit("/", 1)[0]
        if fam not in fams and not fam.startswith("summary"):
            fams.append(fam)
    return fams


def tensorboard_writers(trainer: Any) -> list[Any]:
    """SummaryWriter-like experiments of the trainer's loggers that can take images/histograms."""
    out = []
    for logger in getattr(trainer, "loggers", []):
        exp = getattr(logger, "experiment", None)
        if exp is not None and hasattr(exp, "add_image") and hasattr(exp, "add_histogram_raw"):
            out.append(exp)
    return out


def log_scalars(trainer: Any, metrics: Mapping[str, float], step: int) -> None:
    """Scalars to every logger: TensorBoard loggers get one event holding all values (one ``Summary`` with
    many values instead of one event per tag — same tags, cheaper); others get ``Logger.log_metrics``."""
    from lightning.pytorch.loggers import TensorBoardLogger

    for logger in getattr(trainer, "loggers", []):
        exp = logger.experiment if isinstance(logger, TensorBoardLogger) else None
        torch_tb = exp is not None and type(exp).__module__.startswith("torch.utils.tensorboard")
        writer = getattr(exp, "file_writer", None) if torch_tb else None
        if writer is not None and hasattr(writer, "add_summary"):
            from tensorboard.compat.proto.summary_pb2 import Summary

            summary = Summary(value=[Summary.Value(tag=k, simple_value=float(v)) for k, v in metrics.items()])
            writer.add_summary(summary, step)
        else:
            logger.log_metrics(dict(metrics), step=step)


def add_custom_scalars(trainer: Any, prefix: str, families: list[str], category: str | None = None,
                       depth_tags: list[str] | None = None, summary: list[str] | None = None) -> None:
    """A custom-scalars layout: one chart per summary scalar (category ``"<prefix> summary"``), then one
    Multiline chart per family matching its depth tags — every depth (``prefix/family/\\d+``) when
    ``depth_tags`` is None, else exactly those depths (few lines, each named by its tag)."""
    layout: dict[str, dict[str, list]] = {}
    if summary:
        layout[f"{prefix} summary"] = {name: ["Multiline", [f"^{re.escape(prefix)}/summary/{re.escape(name)}$"]]
                                        for name in summary}
    charts = {}
    for fam in families:
        if depth_tags is None:
            charts[fam] = ["Multiline", [f"^{re.escape(prefix)}/{re.escape(fam)}/\\d+$"]]
        else:
            title = f"{fam} @ depth {', '.join(depth_tags)}"
            charts[title] = ["Multiline", [f"^{re.escape(prefix)}/{re.escape(fam)}/{dd}$" for dd in depth_tags]]
    layout[category or prefix] = charts
    for exp in tensorboard_writers(trainer):
        if hasattr(exp, "add_custom_scalars"):
            exp.add_custom_scalars(layout)


def add_text(trainer: Any, tag: str, text: str, step: int = 0) -> None:
    for exp in tensorboard_writers(trainer):
        if hasattr(exp, "add_text"):
            exp.add_text(tag, text, global_step=step)


def figure_dir(trainer: Any, dirpath: str | None) -> str | None:
    """Where figures go as PNG files: ``dirpath`` if given, else ``<trainer.log_dir>/resctl_figures`` when the
    trainer has loggers but none takes images; None when TensorBoard takes them (or there is no logger)."""
    if dirpath is not None:
        return dirpath
    if not getattr(trainer, "loggers", None) or tensorboard_writers(trainer):
        return None
    import os

    base = getattr(trainer, "log_dir", None) or getattr(trainer, "default_root_dir", ".")
    return os.path.join(base, "resctl_figures")


def emit_figure(trainer: Any, prefix: str, tag: str, fig: Any, step: int, dirpath: str | None = None) -> None:
    """A matplotlib figure as a TensorBoard image ``f"{prefix}/{tag}"`` and/or a PNG file
    ``<dir>/<tag with '/' -> '_'>_step<step>.png`` (see :func:`figure_dir`); rank zero only."""
    from ..plots import figure_to_array

    png_dir = figure_dir(trainer, dirpath)
    writers = tensorboard_writers(trainer)
    if writers:
        add_image(trainer, f"{prefix}/{tag}", figure_to_array(fig, close=False), step)
    if png_dir is not None:
        import os

        os.makedirs(png_dir, exist_ok=True)
        fig.savefig(os.path.join(png_dir, f"{tag.replace('/', '_')}_step{int(step):06d}.png"))


def add_image(trainer: Any, tag: str, array: np.ndarray, step: int) -> None:
    for exp in tensorboard_writers(trainer):
        exp.add_image(tag, array, global_step=step, dataformats="CHW")


def add_histogram_raw(trainer: Any, tag: str, counts: torch.Tensor, edges: torch.Tensor, step: int) -> None:
    """Histogram from fixed-bin ``counts`` (B,) over ``edges`` (B + 1,)."""
    counts = counts.detach().double().cpu()
    total = float(counts.sum())
    if total <= 0:
        return
    edges = edges.detach().double().cpu()
    centers = (edges[:-1] + edges[1:]) / 2
    nz = counts > 0
    mn = float(edges[:-1][nz].min())
    mx = float(edges[1:][nz].max())
    s = float((counts * centers).sum())
    ss = float((counts * centers.square()).sum())
    for exp in tensorboard_writers(trainer):
        exp.add_histogram_raw(
            tag,
            min=mn,
            max=mx,
            num=total,
            sum=s,
            sum_squares=ss,
            bucket_limits=edges[1:].tolist(),
            bucket_counts=counts.tolist(),
            global_step=step,
        )


def depth_entries(sites: list) -> list[tuple[Any, int]]:
    """One entry ``(site, position)`` per merge (a site whose expression runs several merges per forward,
    e.g. inside a ``for`` loop, lists them in ``site.positions``), ordered by chain, then position."""
    entries = []
    for s in sites:
        for p in getattr(s, "positions", (getattr(s, "position", 0),)):
            entries.append((s, int(p)))
    entries.sort(key=lambda e: (getattr(e[0], "chain", 0), e[1]))
    return entries


def rules_of(sites: list) -> list:
    """The distinct configured rules of ``sites`` (one per patch)."""
    out: list = []
    for s in sites:
        rule = getattr(s, "rule", None)
        if rule is not None and all(rule is not r for r in out):
            out.append(rule)
    return out


class PositionCounter:
    """Which of a site's positions a call is. Chain sites know it (``site.current_position``); for a
    per-merge site run several times per forward (a ``for`` loop) the i-th call since :meth:`reset` is
    ``positions[i % len(positions)]`` — every forward runs each position once, in order."""

    def __init__(self) -> None:
        self._calls: dict[int, int] = {}

    def reset(self) -> None:
        self._calls.clear()

    def __call__(self, site: Any) -> int:
        positions = getattr(site, "positions", None) or (getattr(site, "position", 0),)
        if len(positions) == 1:
            return int(positions[0])
        rule = getattr(site, "rule", None)
        if getattr(rule, "kind", None) == "chain":
            return int(site.current_position)
        i = self._calls.get(id(site), 0)
        self._calls[id(site)] = i + 1
        return int(positions[i % len(positions)])
