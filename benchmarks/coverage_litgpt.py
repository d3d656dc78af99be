"""Coverage sweep of ``patch_residuals`` over LitGPT's config zoo (``litgpt.config.configs``).

Every entry is built as ``litgpt.model.GPT`` from its config shrunk (:func:`shrink_config`: 2 layers, width 32,
2 heads of 16, feed-forward 64, 4 experts, vocabulary 128; random init, nothing downloaded) and run through
the checks of :func:`benchmarks.coverage_hf.run_checks` on random token ids (2 x 8).

The structural expectation (:func:`expected_merges`) is read from LitGPT's ``Block``: ``x = attention_output +
x`` then ``return mlp(x_normed) + x`` — 2 merges per layer; with ``parallel_residual=True`` both branches read
the block's input and the block is one merge of its input and ``attention + mlp`` (docs/surgery.md): 1 per layer.
The MLP class (``GptNeoxMLP``, ``LLaMAMLP``, ``GemmaMLP``, ``LLaMAMoE``), post-branch norms, sliding windows and
latent attention change the branches, not the count.

``benchmarks/coverage.py --library litgpt`` is the command line; the test suite runs a fixed sample.
"""
from __future__ import annotations

from typing import Optional

import torch

from benchmarks.coverage_hf import FamilyResult, run_checks

__all__ = ["config_names", "shrink_config", "expected_merges", "run_config", "NOTES"]

LAYERS = 2
HIDDEN = 32
HEADS = 2
HEAD_SIZE = HIDDEN // HEADS
FFN = 64
EXPERTS = 4
VOCAB = 128
SEQ = 8
_LATENT = {"q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16}

#: what a look at the configs that do not match showed (printed with their row in docs/coverage.md)
NOTES: dict = {}


def config_names() -> list:
    """The names of every entry of ``litgpt.config.configs``, in LitGPT's order."""
    from litgpt.config import configs

    return [c["name"] for c in configs]


def shrink_config(name: str):
    """LitGPT's config ``name`` shrunk: ``LAYERS`` layers, ``HIDDEN`` width, ``HEADS`` heads of ``HEAD_SIZE``
    (grouped-query configs keep one key/value group), ``FFN`` feed-forward, ``EXPERTS`` experts (at most 2 per
    token, expert groups cut to 2), latent attention ranks of 8-16, ``VOCAB`` tokens, dropout-free."""
    from litgpt.config import Config, name_to_config

    base = name_to_config[name]
    over = dict(n_layer=LAYERS, n_embd=HIDDEN, n_head=HEADS, head_size=HEAD_SIZE, intermediate_size=FFN,
                vocab_size=VOCAB, padded_vocab_size=VOCAB, block_size=4 * SEQ)
    groups = base.get("n_query_groups")
    over["n_query_groups"] = HEADS if groups is None or groups == base.get("n_head", 32) else 1
    if base.get("moe_intermediate_size"):
        over["moe_intermediate_size"] = FFN // 2
    if base.get("n_expert"):
        over["n_expert"] = EXPERTS
        over["n_expert_per_token"] = min(base.get("n_expert_per_token") or 1, 2)
    if base.get("n_expert_groups"):
        over["n_expert_groups"] = 2
        over["n_topk_groups"] = 1
        over["n_topk_scores_per_group"] = min(base.get("n_topk_scores_per_group") or 1, EXPERTS // 2)
        over["n_expert_per_token"] = min(over.get("n_expert_per_token", 1), EXPERTS // 2)
    if base.get("first_k_dense_replace"):
        over["first_k_dense_replace"] = 1
    if base.get("latent_attention"):
        over["latent_attention"] = {**base["latent_attention"], **_LATENT}
    if base.get("sliding_window_size"):
        over["sliding_window_size"] = min(base["sliding_window_size"], SEQ // 2)
    return Config.from_name(name, **over)


def expected_merges(cfg) -> tuple:
    """(expected merge count, how it was derived) from LitGPT's ``Block`` structure: 2 per layer (attention,
    MLP), 1 per layer with ``parallel_residual`` (one merge of the block's input and attention + MLP)."""
    n = cfg.n_layer
    if cfg.parallel_residual:
        return n, f"1 x {n} layers (parallel_residual: one merge of attention + MLP)"
    return 2 * n, f"2 x {n} layers"


def _init_empty_parameters(model) -> None:
    """LitGPT leaves a few parameters as ``torch.empty`` (DeepSeek's router ``weight``: meant to be loaded):
    give them a small normal init so that a random-init model computes finite values."""
    for module in model.modules():
        if type(module).__name__ == "GroupedTopkRouter":
            torch.nn.init.normal_(module.weight, std=0.02)


def _call(model, x):
    return model(x)


def run_config(name: str, timeout: Optional[float] = 30.0) -> FamilyResult:
    """Build and check one LitGPT config (:func:`~benchmarks.coverage_hf.run_checks`); never raises."""

    def build(res):
        from litgpt.model import GPT

        cfg = shrink_config(name)
        res.expected, res.expectation = expected_merges(cfg)
        res.cls = f"GPT ({cfg.mlp_class_name}{', parallel' if cfg.parallel_residual else ''})"
        torch.manual_seed(0)
        model = GPT(cfg)
        _init_empty_parameters(model)
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
        return model, ids, _call

    return run_checks(FamilyResult(name, "GPT"), build, timeout, NOTES, build_what="the shrunken config")
