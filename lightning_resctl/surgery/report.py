"""PatchReport: what :func:`patch_residuals` patched, what it skipped and why (the last step of the patch:
observe -> classify -> plan -> bind -> **describe**)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

__all__ = ["SiteInfo", "SkippedInfo", "ChainInfo", "PatchReport", "describe"]


@dataclass
class SiteInfo:
    """One patched merge (one execution of a patched addition in the observed forward)."""

    path: str                 # module path of the module whose forward holds the addition ("" = root)
    location: str             # "file:line"
    source_line: str          # that line's text, stripped
    stream_shape: tuple       # shape of the stream (and of the update) as the model sees it
    chain: int                # chain id (0, 1, ...) in order of first execution
    position: int             # depth of this merge in its chain (0 = first merge)
    method: str               # the merge rule's registered name
    dim: int = -1             # feature dim as the model sees it (-1, or 1 for channels-first)
    stream_operand: str = ""  # "left" or "right": which operand of the addition is the stream
    site: Any = field(default=None, repr=False, compare=False)  # the MergeSite that runs this merge
    branch: str = ""          # what the update's branch is: "attn", "mlp", "attn+mlp" (parallel), "conv" or ""
    function: str = ""        # the free function holding the addition (e.g. "dropout_add"), "" when it is in
    #                           the module's own method; ``location`` is then in that function
    called_at: str = ""       # "file:line" of the call in the module's method that reaches ``function``
    parallel_parts: tuple = ()  # a parallel block's earlier additions merged here ("file:line: source"), in order

    @property
    def module(self) -> nn.Module | None:
        """The merge module: a ResController, an MGRMerge (for this position), or None for "add"."""
        if self.site is None:
            return None
        return self.site.merge_module(self.position)

    def to_dict(self) -> dict:
        return {
            "path": self.path,
            "location": self.location,
            "source_line": self.source_line,
            "stream_shape": list(self.stream_shape),
            "chain": self.chain,
            "position": self.position,
            "method": self.method,
            "dim": self.dim,
            "stream_operand": self.stream_operand,
            "branch": self.branch,
            "function": self.function,
            "called_at": self.called_at,
            "parallel_parts": list(self.parallel_parts),
        }


@dataclass
class SkippedInfo:
    """An addition that was considered and not patched, with the reason."""

    path: str
    location: str
    source_line: str
    reason: str
    count: int = 1            # how many executions of this addition (same module, same line) were skipped

    def to_dict(self) -> dict:
        return {"path": self.path, "location": self.location, "source_line": self.source_line,
                "reason": self.reason, "count": self.count}


@dataclass
class ChainInfo:
    """One residual chain: the merges one stream passes through, in order."""

    index: int
    length: int
    stream_shape: tuple
    dim: int
    owner: str = ""           # module path where the chain's merge modules are registered (MGR)
    module: Any = field(default=None, repr=False, compare=False)  # the MGRChain (MGR) or None
    note: str | None = None   # e.g. the MGR gate-bias init clamp message

    @property
    def output_pool(self):
        """The chain's output pool (MGR's ``MGRPool``); None for other methods."""
        return None if self.module is None else self.module.output_pool

    def to_dict(self) -> dict:
        return {"index": self.index, "length": self.length, "stream_shape": list(self.stream_shape),
                "dim": self.dim, "owner": self.owner, "note": self.note}


@dataclass
class PatchReport:
    """Result of :func:`patch_residuals`.

    ``sites``: one :class:`SiteInfo` per patched merge, ordered by chain then position;
    ``skipped``: :class:`SkippedInfo` for every addition of two tensors that was not patched;
    ``chains``: :class:`ChainInfo` per chain; ``new_parameters``: names (in ``model.state_dict()``)
    of the parameters the patch added (MGR only) — an unpatched checkpoint lacks exactly these keys.
    """

    method: str
    options: dict
    sites: list[SiteInfo] = field(default_factory=list)
    skipped: list[SkippedInfo] = field(default_factory=list)
    chains: list[ChainInfo] = field(default_factory=list)
    new_parameters: list[str] = field(default_factory=list)
    new_keys: list[str] = field(default_factory=list)  # every state_dict key the patch added (sites' records too)
    searched: str = ""        # what the search covered (module count, additions seen)
    patch_seconds: float = 0.0

    def __len__(self) -> int:
        return len(self.sites)

    def to_dict(self) -> dict:
        return {
            "method": self.method,
            "options": {k: (v if isinstance(v, (int, float, str, bool, type(None))) else repr(v))
                        for k, v in self.options.items()},
            "sites": [s.to_dict() for s in self.sites],
            "skipped": [s.to_dict() for s in self.skipped],
            "chains": [c.to_dict() for c in self.chains],
            "new_parameters": list(self.new_parameters),
            "searched": self.searched,
            "patch_seconds": self.patch_seconds,
        }

    def __str__(self) -> str:
        head = (f"PatchReport: method={self.method!r}, {len(self.sites)} merge(s) patched in "
                f"{len(self.chains)} chain(s), {len(self.skipped)} addition(s) skipped")
        lines = [head]
        if self.sites:
            rows = [("chain", "pos", "module", "branch", "shape", "location", "source")]
            for s in self.sites:
                where = s.location
                if s.function:
                    where += f" in {s.function}() called at {s.called_at.rsplit(':', 1)[-1]}" \
                        if s.called_at.rsplit(":", 1)[0] == s.location.rsplit(":", 1)[0] \
                        else f" in {s.function}() called at {s.called_at}"
                if s.parallel_parts:   # a parallel block written as several additions: where the others are
                    where += " (with " + ", ".join(p.split(": ", 1)[0].rsplit(":", 1)[-1] if
                                                   p.split(": ", 1)[0].rsplit(":", 1)[0] == s.location.rsplit(":", 1)[0]
                                                   else p.split(": ", 1)[0] for p in s.parallel_parts) + ")"
                rows.append((str(s.chain), str(s.position), s.path or "<root>", s.branch or "-",
                             "x".join(str(d) for d in s.stream_shape) + ("" if s.dim == -1 else f" (dim {s.dim})"),
                             where, _clip(s.source_line, 48)))
            lines += _table(rows)
        if self.skipped:
            lines.append("skipped:")
            rows = [("module", "location", "source", "reason")]
            for s in self.skipped:
                rows.append((s.path or "<root>", s.location + (f" (x{s.count})" if s.count > 1 else ""),
                             _clip(s.source_line, 40), s.reason))
            lines += _table(rows)
        for c in self.chains:
            if c.note:
                lines.append(f"chain {c.index}: {c.note}")
        if self.new_parameters:
            lines.append(f"new parameters ({len(self.new_parameters)}): "
                         + ", ".join(self.new_parameters[:6]) + (" ..." if len(self.new_parameters) > 6 else ""))
        return "\n".join(lines)

    __repr__ = __str__


def describe(report: PatchReport, binding: Any) -> PatchReport:
    """Fill ``report`` with what :func:`~lightning_resctl.surgery.bind.bind` put into the model: its chains, and
    one :class:`SiteInfo` per merge execution (``binding.merges``, by chain then position). Returns ``report``."""
    report.chains.extend(binding.chains)
    for m in binding.merges:
        site = m.site
        report.sites.append(SiteInfo(
            path=site.path, location=site.location, source_line=site.source_line, stream_shape=site.stream_shape,
            chain=m.chain, position=m.position, method=site.method, dim=site.dim,
            stream_operand="left" if m.stream_first else "right", site=site, branch=site.branch,
            function=site.function, called_at=site.called_at, parallel_parts=m.parallel_parts))
    return report


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _table(rows: list[tuple]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for j, r in enumerate(rows):
        out.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if j == 0:
            out.append("  " + "  ".join("-" * w for w in widths))
    return out
