"""Depths: one index per residual merge (ordered by chain, then position), their tags and which get scalars."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


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
    """The per-depth families named by ``tags`` (``prefix/family/dd``), in order, summary scalars left out."""
    fams = []
    for tag in tags:
        fam = tag[len(prefix) + 1 :].rsplit("/", 1)[0]
        if fam not in fams and not fam.startswith("summary"):
            fams.append(fam)
    return fams


def depth_entries(sites: list) -> list[tuple[Any, int]]:
    """One entry ``(site, position)`` per merge (a site whose expression runs several merges per forward,
    e.g. inside a ``for`` loop, lists them in ``site.positions``), ordered by chain, then position."""
    entries = []
    for s in sites:
        for p in getattr(s, "positions", (getattr(s, "position", 0),)):
            entries.append((s, int(p)))
    entries.sort(key=lambda e: (getattr(e[0], "chain", 0), e[1]))
    return entries


def depth_labels(entries: list[tuple[Any, int]]) -> list[str]:
    """``"07 mlp"``: the depth tag and the merge's branch kind (when the surgery knows it)."""
    return [f"{depth_tag(d, len(entries))} {getattr(s, 'branch', '') or ''}".strip()
            for d, (s, _) in enumerate(entries)]


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
