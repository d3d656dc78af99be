"""Merge rules: the one extension point for "what a residual merge computes".

A *rule* is one class (plus its config dataclass, its modules and, if any, its kernels) registered
under one or more names; a built-in rule lives in one folder, ``rules/<name>/`` (``config.py``, ``reference.py``,
``ops.py``, ``modules.py``, ``stats.py``, ``rule.py``: the rule class, which registers itself on import).
Everything else — the surgery, the callbacks, the compare job — asks the rule; nothing else branches on rule names.

Two kinds of rules:

* **per-merge** (:class:`MergeRule`): each merge ``stream + update`` is replaced by
  ``rule.merge(module, stream, update)`` on its own (``add``, ``rescontroller``);
* **stream-carrying chain** (:class:`ChainRule`): the merges of one residual chain share state that
  travels beside the model during one forward (``mgr``, ``attnres``, ``hc`` ...). The rule builds
  one chain module per chain (registered once in the model) and runs it with
  ``state = start(chain, x)`` then, per merge ``k``,
  ``state, h = step(chain, k, state, u, next_k)``: ``h`` is what the model's code sees after the
  merge — the input that the branch of merge ``next_k`` reads, or the chain's output when
  ``next_k == num_merges``.

Registering a rule defined outside the package::

    from dataclasses import dataclass
    from lightning_resctl import register_merge_rule
    from lightning_resctl.rules import MergeRule

    @dataclass
    class HalfConfig:
        scale: float = 0.5

    class Half(MergeRule):
        Config = HalfConfig
        description = "stream + scale * update"

        def merge(self, module, stream, update, inplace):
            return stream + self.config.scale * update

    register_merge_rule("half", Half)
    patch_residuals(model, method="half", scale=0.25)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from torch import Tensor, nn

__all__ = [
    "MergeRule",
    "ChainRule",
    "ChainPosition",
    "NoOptions",
    "RuleEntry",
    "register_merge_rule",
    "merge_rules",
    "get_merge_rule",
    "make_rule",
]


@dataclass
class NoOptions:
    """Config of a rule without options."""


def branches_sum(updates: list) -> Tensor:
    """The update of a parallel block's one merge: its branches' outputs added in the order the model adds them."""
    total = updates[0]
    for u in updates[1:]:
        total = total + u
    return total


class MergeRule:
    """A per-merge rule. Subclasses set :attr:`Config` (a dataclass: the options, their defaults and
    their help in one place) and implement :meth:`merge`; they may add :meth:`validate`,
    :meth:`build_merge`, :meth:`refuse` and diagnostics (:meth:`make_stats`, :meth:`observe`).

    An instance is one configured rule: ``rule.name`` (the registered name it was made from) and
    ``rule.config`` (a validated ``Config``)."""

    Config: ClassVar[type] = NoOptions
    description: ClassVar[str] = ""
    kind: ClassVar[str] = "merge"
    #: Whether the rule's docs call it identity (the unpatched model) at init: True, False, or the options under
    #: which it is, e.g. ``{"init": "residual"}``; the compare job flags a rule that claims it but starts away
    #: from plain.
    identity_at_init: ClassVar[bool | dict] = False
    #: False when the rule cannot run inside activation checkpointing (a recomputed block would replay its merges).
    supports_checkpointing: ClassVar[bool] = True
    #: Options that choose how the math runs, not what it computes: recorded with a checkpoint, but a checkpoint
    #: loads whatever their value (a model trained with backend="triton" on a GPU resumes with "auto" on CPU).
    execution_options: ClassVar[tuple] = ("backend",)
    #: True when :meth:`merge` honours ``inplace`` itself (writes into the stream / update and returns it);
    #: otherwise the merge site writes the rule's result into that tensor (see :class:`MergeSite`).
    merges_in_place: ClassVar[bool] = False

    def __init__(self, name: str, config: Any):
        self.name = name
        self.config = config
        self.validate(config)

    # ------------------------------------------------------------------ configuration
    def validate(self, config: Any) -> None:
        """Raise ValueError/TypeError naming the option and the value when ``config`` is invalid.

        The default asks the config: a ``Config`` with a ``validate()`` method (every built-in rule's) checks its
        own options there, the one place of its checks (:mod:`lightning_resctl.rules.checks` has the helpers)."""
        check = getattr(config, "validate", None)
        if callable(check):
            check()

    def options(self) -> dict:
        """The rule's options as a plain dict (what travels with checkpoints and reports)."""
        return dataclasses.asdict(self.config)

    def math_options(self, options: Optional[dict] = None) -> dict:
        """``options`` (default: this rule's) without the :attr:`execution_options`: what a checkpoint must match."""
        options = self.options() if options is None else options
        return {k: v for k, v in options.items() if k not in self.execution_options}

    def summary(self) -> str:
        """A short description of the configured rule for one-line messages, e.g. ``"n=4"``."""
        return ""

    def refuse(self, model: nn.Module) -> Optional[str]:
        """A reason why this rule cannot be applied to ``model`` (checked before patching), or None."""
        if self.supports_checkpointing:
            return None
        for path, mod in model.named_modules():
            if getattr(mod, "gradient_checkpointing", False) is True:
                return (f"method={self.name!r} cannot be used with activation checkpointing (enabled on "
                        f"{path or type(model).__name__!r}): its state travels beside the model between merges "
                        "and a recomputed block would replay its merges. Disable gradient checkpointing or use a "
                        "per-merge rule (e.g. method='rescontroller')")
        return None

    # ------------------------------------------------------------------ per-merge runtime
    def build_merge(self, dim: int) -> Optional[nn.Module]:
        """The module one merge site holds (its parameters), or None. ``dim``: feature dim of the stream."""
        return None

    def build_merge_sized(self, dim: int, width: int) -> Optional[nn.Module]:
        """:meth:`build_merge` given also ``width``, the stream's size along ``dim`` (what the patch calls): a rule
        whose merge module holds parameters of the stream's width (``laurel``, ``ddl``) overrides it; the default
        calls :meth:`build_merge`."""
        return self.build_merge(dim)

    def merge(self, module: Optional[nn.Module], stream: Tensor, update: Tensor, inplace: Optional[str]) -> Tensor:
        """The merged stream. ``inplace``: None, ``"stream"`` (``stream += update``) or ``"update"``; only a rule
        with :attr:`merges_in_place` acts on it (for the others the site writes the result into that tensor)."""
        raise NotImplementedError

    def merge_written(self, module: Optional[nn.Module], stream: Tensor, update: Tensor, inplace: Optional[str],
                      stream_first: bool) -> Tensor:
        """:meth:`merge` of an addition the model writes with the stream on the left (``stream_first``) or on
        the right. The default ignores the order; a rule that reproduces the addition as written overrides it
        (``add``: the result's memory layout follows the left operand)."""
        return self.merge(module, stream, update, inplace)

    def merge_parallel(self, module: Optional[nn.Module], stream: Tensor, updates: list, partial: Tensor,
                       inplace: Optional[str], stream_first: bool = True) -> Tensor:
        """One merge of a parallel block the model writes as several additions (``x = attn_out + x;
        return mlp_out + x``: every branch reads ``stream``, the block's input): ``updates`` are the branches'
        outputs in the order they are added, ``partial`` what the model's additions before the last one
        computed (``stream + updates[0] + ...``), ``inplace`` and ``stream_first`` the spelling of the last one.
        The default merges the branches' sum: ``merge(module, stream, updates[0] + updates[1] + ..., None)``."""
        return self.merge(module, stream, branches_sum(updates), None)

    def merge_module(self, site: Any, position: int) -> Optional[nn.Module]:
        """The module that holds merge ``position``'s parameters (diagnostics and reports)."""
        return getattr(site, "merge", None)

    # ------------------------------------------------------------------ diagnostics
    def make_stats(self, num_depths: int, model: nn.Module) -> Optional[Any]:
        """A torchmetrics ``Metric`` with this rule's diagnostics families, or None.

        Its ``compute()`` returns ``{family: (D,) or (D, n) tensor}``; a family named ``*_hist``
        holds ``(D, n, bins)`` counts over ``stats.histogram_edges()``."""
        return None

    def observe(self, stats: Any, depth: int, site: Any, position: int, stream: Tensor, update: Tensor,
                state: Any) -> None:
        """Update ``stats`` with merge ``position`` of ``site`` (detached tensors, no grad)."""

    def runnable_options(self, options: dict) -> dict:
        """A checkpoint's recorded ``options`` of this rule, made runnable on this machine: only
        :attr:`execution_options` may change (the math stays the one recorded); re-applying a recorded patch
        (:func:`~lightning_resctl.surgery.patch_from_state_dict`) uses the result and warns about each change.
        The default: a ``backend`` that needs Triton (``"triton"``, ``"native"``) where Triton cannot run becomes
        ``"auto"``; a rule whose execution options need other checks overrides this."""
        from ..runtime.backends import ALIASES
        from ..runtime.triton import triton_available

        backend = options.get("backend")
        if ("backend" in self.execution_options and isinstance(backend, str)
                and ALIASES.get(backend, backend) == "triton" and not triton_available()):
            return {**options, "backend": "auto"}
        return options


class ChainRule(MergeRule):
    """A stream-carrying chain rule (see the module docstring for the runtime contract)."""

    kind: ClassVar[str] = "chain"
    #: attribute name prefix of the chain modules registered in the model
    chain_attr: ClassVar[str] = "_resctl_chain"

    def build_chain(self, dim: int, num_merges: int) -> nn.Module:
        raise NotImplementedError

    def build_chain_in_blocks(self, dim: int, blocks: tuple) -> nn.Module:
        """The chain module of a chain whose merges the model's blocks run in groups: ``blocks[b]`` merges in block
        b, in order (the surgery's grouping, ``surgery.plan.chain_blocks``; they sum to the chain's merges). What
        the patch calls; a rule that acts per block (``dwa``) overrides it, the others ignore the grouping."""
        return self.build_chain(dim, sum(blocks))

    def start(self, chain: nn.Module, x: Tensor) -> Any:
        """State entering the chain's first merge; ``x``: the stream, features last."""
        raise NotImplementedError

    def start_apart(self, chain: nn.Module, x: Tensor) -> Any:
        """:meth:`start` when the chain's merges run in compiled graphs apart from its owner's forward (blocks
        compiled one by one): a rule whose state's structure grows from merge to merge returns one of a structure
        that does not (a compiled graph per structure), the same math. The default: :meth:`start`."""
        return self.start(chain, x)

    def step(self, chain: nn.Module, k: int, state: Any, u: Tensor, next_k: int) -> tuple[Any, Tensor]:
        """Merge ``u`` as merge ``k``; return ``(state, h)``, ``h`` = what merge ``next_k``'s branch reads
        (``next_k == num_merges``: the chain output). Merges strictly between ``k`` and ``next_k`` do not
        run in this forward (e.g. ``if self.training:`` merges in eval): they leave the state as it is (a rule
        whose state has a fixed structure per merge treats them as a zero update, e.g. MGR's accumulating
        merges append a zero stream); their parameters are not used."""
        raise NotImplementedError

    def skip(self, chain: nn.Module, k: int, state: Any, next_k: int) -> tuple[Any, Tensor]:
        """Ablation: merge ``k``'s update is dropped; same return as :meth:`step`."""
        raise NotImplementedError

    def position(self, chain: nn.Module, k: int, next_k: int) -> "ChainPosition":
        """Merge ``k`` of ``chain`` read next by merge ``next_k``, as one module the merge site calls (built once per
        site and position, outside the forward). The default calls :meth:`step` / :meth:`skip` with the positions: a
        compiled graph per position. A rule whose merges share their structure returns a :class:`ChainPosition`
        that reaches the merge's own modules directly and keeps only values every such merge shares, so identical
        blocks compiled one by one (``block.compile()``) share one graph at any depth."""
        return ChainPosition(self, chain, k, next_k)

    def streams(self, chain: nn.Module, state: Any) -> Optional[Tensor]:
        """The streams ``(..., m, C)`` held in ``state`` (diagnostics), or None."""
        return None

    def stage_state(self, chain: nn.Module, state: Any = None, *, packed: Optional[tuple] = None) -> Any:
        """The chain's state across a pipeline stage boundary (``ResidualParallelStrategy(pipeline_parallel_size=
        ...)``): ``stage_state(chain, state)`` packs the state between two merges into a tuple of tensors, what the
        next stage reads of it, each once (the stage sends them beside the stream the model's code passes on);
        ``stage_state(chain, packed=tensors)`` rebuilds the state from them on the next stage, once per
        microbatch (per-forward bookkeeping the rule keeps on its modules starts afresh there). Only tensors cross
        a stage boundary (dtype and shape free: an int64 tensor carries a structure's sizes); a value the next
        stage can compute from the tensors and the chain module (replicated on every stage) need not travel.

        The default declares no stage state: a pipeline refuses the rule, naming it. ``packed`` keyword-only, so
        that ``stage_state(chain, state)`` is always the packing."""
        raise NotImplementedError(
            f"method={self.name!r} ({type(self).__name__}) declares no stage state: ChainRule.stage_state(chain, "
            "state) -> tuple of tensors and stage_state(chain, packed=tensors) -> state, for a pipeline stage "
            "boundary")

    def num_merges(self, chain: nn.Module) -> int:
        return int(chain.num_merges)

    def merge_module(self, site: Any, position: int) -> Optional[nn.Module]:
        chain = site.chain_module
        merges = getattr(chain, "merges", None)
        return merges[position] if merges is not None else chain


class ChainPosition(nn.Module):
    """Merge ``k`` of a chain, read next by merge ``next_k``, as a merge site runs it: ``step(state, u)`` and
    ``skip(state)`` return ``(state, h)`` as :meth:`ChainRule.step` / :meth:`ChainRule.skip` do. ``first``: the chain
    starts here (the site passes ``state`` None to :meth:`ChainRule.start` first); ``output``: ``h`` is the chain's
    output. The rule and the chain are referenced, not registered (the chain module owns its parameters once).

    Under ``torch.compile`` a traced merge reads from this module only what its step reads: a subclass keeps the
    positions themselves (``k``, ``next_k``, read for messages only) out of its step, so that one graph serves every
    merge of the same structure (dynamo guards on the Python values a trace reads, not on the module's identity)."""

    #: True when the step reads no position (one compiled graph serves every merge of the same structure)
    shares_graphs: ClassVar[bool] = False

    def __init__(self, rule: Optional["ChainRule"], chain: nn.Module, k: int, next_k: int, first: bool = False):
        super().__init__()
        self.__dict__["rule"] = rule
        self.__dict__["chain"] = chain
        self.k, self.next_k, self.first = int(k), int(next_k), bool(first)
        self.output = self.next_k >= (rule.num_merges(chain) if rule is not None else int(chain.num_merges))

    def step(self, state: Any, u: Tensor) -> tuple[Any, Tensor]:
        return self.rule.step(self.chain, self.k, state, u, self.next_k)

    def skip(self, state: Any) -> tuple[Any, Tensor]:
        return self.rule.skip(self.chain, self.k, state, self.next_k)

    def extra_repr(self) -> str:
        return f"k={self.k}, next_k={self.next_k}"


# ---------------------------------------------------------------------------------------------- registry
@dataclass(frozen=True)
class RuleEntry:
    """One registered name: the rule class and the options the name presets (e.g. ``gating``)."""

    name: str
    rule_class: type
    preset: tuple  # ((option, value), ...)
    description: str

    @property
    def kind(self) -> str:
        return self.rule_class.kind

    def option_names(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self.rule_class.Config)]

    def defaults(self) -> dict:
        """Every option with the value this name uses when the caller gives none."""
        out = {}
        for f in dataclasses.fields(self.rule_class.Config):
            if f.default is not dataclasses.MISSING:
                out[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                out[f.name] = f.default_factory()  # type: ignore[misc]
        out.update(dict(self.preset))
        return out


_REGISTRY: dict[str, RuleEntry] = {}


def register_merge_rule(name: str, rule_class: type, *, description: Optional[str] = None, replace: bool = False,
                        **preset: Any) -> RuleEntry:
    """Register ``rule_class`` (a :class:`MergeRule` subclass) under ``name``; ``preset`` fixes options
    for this name (e.g. ``register_merge_rule("mgr-independent", MGRRule, gating="independent")``).

    The name then works everywhere a method is accepted: :func:`patch_residuals`, the callbacks and
    ``python -m lightning_resctl compare --methods``. Registering a taken name raises ValueError unless
    ``replace=True``."""
    if not isinstance(name, str) or not name or name.strip() != name or name == "plain":
        raise ValueError(f"name must be a non-empty string without surrounding spaces (and not 'plain'), got {name!r}")
    if not (isinstance(rule_class, type) and issubclass(rule_class, MergeRule)):
        raise TypeError(f"rule_class must be a subclass of lightning_resctl.rules.MergeRule, got {rule_class!r}")
    if not dataclasses.is_dataclass(rule_class.Config):
        raise TypeError(f"{rule_class.__name__}.Config must be a dataclass, got {rule_class.Config!r}")
    if name in _REGISTRY and not replace:
        raise ValueError(f"a merge rule named {name!r} is registered already ({_REGISTRY[name].rule_class.__name__}); "
                         "pass replace=True to replace it")
    valid = {f.name for f in dataclasses.fields(rule_class.Config)}
    bad = sorted(set(preset) - valid)
    if bad:
        raise ValueError(f"preset option(s) {bad} are not options of {rule_class.__name__} (valid: {sorted(valid)})")
    entry = RuleEntry(name, rule_class, tuple(sorted(preset.items())),
                      description if description is not None else rule_class.description)
    _REGISTRY[name] = entry
    return entry


def merge_rules() -> tuple[str, ...]:
    """The registered merge-rule names, in registration order."""
    return tuple(_REGISTRY)


def get_merge_rule(name: str) -> RuleEntry:
    """The :class:`RuleEntry` registered under ``name``; ValueError listing the names otherwise."""
    if not isinstance(name, str):
        raise TypeError(f"method must be a string naming a merge rule, got {type(name).__name__} {name!r}")
    entry = _REGISTRY.get(name)
    if entry is None:
        raise ValueError(f"method must be one of the registered merge rules {list(_REGISTRY)}, got {name!r}")
    return entry


def make_rule(method: str, options: Optional[dict] = None) -> MergeRule:
    """A configured rule: the name's preset, overridden by ``options``; unknown options and invalid values
    raise ValueError/TypeError naming them."""
    entry = get_merge_rule(method)
    options = dict(options or {})
    valid = entry.option_names()
    bad = sorted(set(options) - set(valid))
    if bad:
        if not valid:
            raise ValueError(f"method={method!r} takes no options, got {bad}")
        raise ValueError(f"unknown option(s) for method={method!r}: {bad} (valid: {valid})")
    clash = sorted(k for k, v in entry.preset if k in options and options[k] != v)
    if clash:
        raise ValueError(f"method={method!r} fixes {', '.join(f'{k}={dict(entry.preset)[k]!r}' for k in clash)}; "
                         f"got {', '.join(f'{k}={options[k]!r}' for k in clash)} (use the base rule's name to choose)")
    kwargs = {**dict(entry.preset), **options}
    config = entry.rule_class.Config(**kwargs)
    return entry.rule_class(method, config)


def rule_name_for_config(config: Any) -> str:
    """The registered name that a rule's config dataclass (e.g. ``MGRConfig(streams=8)``) stands for: the first
    name of the rule whose ``Config`` is ``type(config)`` that presets no option. TypeError when no rule has it."""
    for name, entry in _REGISTRY.items():
        if type(config) is entry.rule_class.Config and not entry.preset:
            return name
    raise TypeError(f"{type(config).__name__} is not the config of any registered merge rule (registered: "
                    f"{list(_REGISTRY)}): pass a rule's config (e.g. MGRConfig(streams=8)) or method='<name>'")
