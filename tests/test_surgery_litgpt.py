"""patch_residuals on LitGPT's real ``GPT`` / ``Block`` (litgpt 0.5.13, tiny random-init configs, nothing downloaded).

* ``parallel_residual=True`` (Pythia / GPT-NeoX, Phi, Falcon): ``Block.forward`` writes the parallel residual in
  two statements, ``x = attention_output + x`` then ``return mlp(x_normed) + x`` with the MLP reading the block's
  input: one ``attn+mlp`` merge per block, the whole stream one chain.
* ``LLaMAMoE`` (Mixtral-like): the experts' outputs are written with ``y[token_idx] += ...``: the MoE merge is
  found, two merges per block, one chain.
"""
from __future__ import annotations

import pytest
import torch
from litgpt.config import Config
from litgpt.model import GPT, Block

from lightning_resctl.surgery import merge_sites, patch_residuals
from surgery_checks import add_and_unpatch_are_bitwise, one_thread  # noqa: F401 (module fixture)

IDS = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(1))
SMALL = dict(n_layer=2, n_embd=16, n_head=2, n_query_groups=2, head_size=8, intermediate_size=32,
             padded_vocab_size=64, vocab_size=64, block_size=16)


def _gpt(name, **over):
    torch.manual_seed(0)
    return GPT(Config.from_name(name, **{**SMALL, **over}))


def _trains(model, method):
    patch_residuals(model, method=method, example_input=IDS, backend="torch-eager")  # no compiled region in the suite
    out = model(IDS)
    out.pow(2).mean().backward()
    assert torch.isfinite(out).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("name", ["pythia-14m", "phi-2", "falcon-7b"])
def test_parallel_residual_block_is_one_merge_per_block_in_one_chain(name):
    model = _gpt(name)
    assert model.config.parallel_residual and isinstance(model.transformer.h[0], Block)
    report = add_and_unpatch_are_bitwise(model, IDS)
    assert [c.length for c in report.chains] == [2]
    assert [(s.path, s.branch) for s in report.sites] == [("transformer.h.0", "attn+mlp"),
                                                          ("transformer.h.1", "attn+mlp")]
    assert [s.source_line for s in report.sites] == ["return self.post_mlp_norm(self.mlp(x_normed)) + x"] * 2
    assert [s.parallel_parts[0].split(": ", 1)[1] for s in report.sites] == ["x = attention_output + x"] * 2
    # only the rotary embedding's sum is skipped; nothing of the block is added raw
    assert {s.source_line for s in report.skipped} == {"roped = (x * cos) + (rotated * sin)"}
    for method in ("rescontroller", "mgr"):
        _trains(_gpt(name), method)


def test_parallel_residual_block_merges_the_input_with_the_branches_sum():
    """The rule sees the block's input as the stream and ``attention + mlp`` as the update: compare each
    patched block with ``controller(x, attn + mlp)`` computed by hand with the same controller."""
    model = _gpt("pythia-14m")
    patch_residuals(model, method="rescontroller", example_input=IDS, backend="torch-eager")
    block = model.transformer.h[0]
    (site,) = merge_sites(block)
    seen = {}

    def record(s, stream, update, streams):
        seen["stream"], seen["update"] = stream.detach().clone(), update.detach().clone()

    site.observer = record
    x = torch.randn(2, 6, 16)
    cos, sin = model.cos[:6].unsqueeze(0), model.sin[:6].unsqueeze(0)   # as GPT.forward passes them
    mask = None
    out = block(x, cos, sin, mask)
    attn = block.attn(block.norm_1(x), cos, sin, mask)
    mlp = block.mlp(block.norm_2(x))
    torch.testing.assert_close(seen["stream"], x, rtol=0, atol=0)
    torch.testing.assert_close(seen["update"], attn + mlp)
    torch.testing.assert_close(out, site.rule.merge(site.merge, x, attn + mlp, None))


def test_llama_moe_block_is_two_merges_per_block_in_one_chain():
    model = _gpt("Mixtral-8x7B-v0.1", n_expert=4, n_expert_per_token=2)
    assert type(model.transformer.h[0].mlp).__name__ == "LLaMAMoE"
    report = add_and_unpatch_are_bitwise(model, IDS)
    assert [c.length for c in report.chains] == [4]
    assert [(s.path, s.branch) for s in report.sites] == [("transformer.h.0", "attn"), ("transformer.h.0", "mlp"),
                                                          ("transformer.h.1", "attn"), ("transformer.h.1", "mlp")]
    for method in ("rescontroller", "mgr"):
        _trains(_gpt("Mixtral-8x7B-v0.1", n_expert=4, n_expert_per_token=2), method)


def test_sequential_litgpt_block_is_two_merges_per_block():
    report = add_and_unpatch_are_bitwise(_gpt("Llama-3.2-1B"), IDS)
    assert [c.length for c in report.chains] == [4]
    assert [s.branch for s in report.sites] == ["attn", "mlp"] * 2
