"""Two ways of writing a block that the surgery must follow through the dataflow (issue: LitGPT's blocks).

* A parallel residual written in two statements (LitGPT's ``Block`` with ``parallel_residual=True``)::

      x = attn_out + x          # both branches read the block's input
      return mlp_out + x

  is one merge of the block's input and ``attn_out + mlp_out`` (docs/surgery.md, "Parallel blocks"): the
  same network as the one-expression form ``x + (attn_out + mlp_out)`` under every rule, bitwise the model
  as written under ``add``.
* A mixture of experts that fills its output by indexed in-place writes (LitGPT's ``LLaMAMoE``:
  ``y[token_idx] += probs * expert(x[token_idx])``; ``index_put_``, ``masked_scatter_``, ``scatter_add_``,
  writes through a view): the output depends on the experts, so ``x + moe(x)`` is a merge.
"""
from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from lightning_resctl.rules import get_merge_rule
from lightning_resctl.surgery import merge_sites, patch_residuals
from surgery_checks import add_and_unpatch_are_bitwise, one_thread  # noqa: F401 (module fixture)

C = 16
SEQ = torch.randn(2, 5, C, generator=torch.Generator().manual_seed(3))
RULES = ("rescontroller", "mgr", "mgr-competitive", "attnres-block", "hc")


def _mlp():
    return nn.Sequential(nn.Linear(C, 2 * C), nn.GELU(), nn.Linear(2 * C, C))


class Par(nn.Module):
    """The issue's minimal form of LitGPT's parallel residual: two statements."""

    def __init__(self):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.attn, self.mlp = nn.Linear(C, C), _mlp()

    def forward(self, x):
        a = self.attn(self.n1(x))
        h = self.n2(x)
        x = a + x
        return self.mlp(h) + x


class ParOne(Par):
    """The same block (same parameters) written as one merge of the two branches' sum."""

    def forward(self, x):
        a = self.attn(self.n1(x))
        h = self.n2(x)
        return x + (a + self.mlp(h))


class ParInPlace(Par):
    """The two statements written in place (on the attention output, then on the partial sum)."""

    def forward(self, x):
        a = self.attn(self.n1(x))
        h = self.n2(x)
        a += x
        a += self.mlp(h)
        return a


class ParInPlaceAlias(Par):
    """In place, returning another name bound to the tensor the additions write (its value is the merge)."""

    def forward(self, x):
        a = self.attn(self.n1(x))
        h = self.n2(x)
        alias = a
        a += x
        a += self.mlp(h)
        return alias


class ParStreamFirst(Par):
    """One expression, stream first: ``x + attn + mlp``."""

    def forward(self, x):
        h = self.n2(x)
        return x + self.attn(self.n1(x)) + self.mlp(h)


class ParThree(Par):
    """Three branches of the block's input added one statement at a time."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Linear(C, C)

    def forward(self, x):
        a = self.attn(self.n1(x))
        h = self.n2(x)
        x = a + x
        x = self.conv(h) + x
        return self.mlp(h) + x


class ParThreeOne(ParThree):
    def forward(self, x):
        a = self.attn(self.n1(x))
        h = self.n2(x)
        return x + (a + self.conv(h) + self.mlp(h))


def _seq(block, n=2):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(C, C), *[block() for _ in range(n)], nn.LayerNorm(C))


@pytest.mark.parametrize("block", [Par, ParInPlace, ParStreamFirst, ParThree])
def test_parallel_block_is_one_merge_of_the_branches_sum(block):
    report = add_and_unpatch_are_bitwise(_seq(block), SEQ)
    assert [(s.chain, s.position) for s in report.sites] == [(0, 0), (0, 1)]
    assert [s.path for s in report.sites] == ["1", "2"]
    assert {s.branch for s in report.sites} == {"attn+mlp"}
    assert [s for s in report.skipped if s.path in ("1", "2")] == []  # every addition of the block is used


@pytest.mark.parametrize("method", RULES)
@pytest.mark.parametrize("pair", [(Par, ParOne), (ParInPlace, ParOne), (ParInPlaceAlias, ParOne),
                                  (ParStreamFirst, ParOne), (ParThree, ParThreeOne)],
                         ids=lambda pair: pair[0].__name__)
def test_parallel_block_is_the_network_of_the_one_expression_form(pair, method):
    """The faithful reading: each rule sees the block's input as the stream and the branches' sum as the
    update, exactly as for ``x + (attn + mlp)``: the two patched models compute the same thing."""
    written, one = _seq(pair[0]), _seq(pair[1])
    one.load_state_dict(written.state_dict())
    opts = {"backend": "torch-eager"} if "backend" in get_merge_rule(method).option_names() else {}
    ra = patch_residuals(written, method=method, example_input=SEQ, **opts)
    rb = patch_residuals(one, method=method, example_input=SEQ, **opts)
    assert [c.length for c in ra.chains] == [c.length for c in rb.chains] == [2]
    torch.manual_seed(5)
    for p, q in zip(written.parameters(), one.parameters()):  # rules whose merges start at identity: move them
        if p.shape == q.shape:
            with torch.no_grad():
                noise = 0.1 * torch.randn_like(p)
                p.add_(noise)
                q.add_(noise)
    out = written(SEQ)
    ref = one(SEQ)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    out.pow(2).mean().backward()
    ref.pow(2).mean().backward()
    for (name, p), q in zip(written.named_parameters(), one.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


class ParLeaky(Par):
    """The attention-updated tensor is read by something else too: not a parallel block."""

    def forward(self, x):
        a = self.attn(self.n1(x))
        h = self.n2(x)
        x = a + x
        return self.mlp(h) + x + 0.5 * self.attn(x)


def test_stream_read_between_the_two_additions_is_refused_naming_the_site():
    with pytest.raises(ValueError, match=r"test_surgery_parallel_moe\.py:\d+.*return self\.mlp\(h\) \+ x"):
        patch_residuals(_seq(ParLeaky), method="rescontroller", example_input=SEQ)


def test_parallel_site_checks_that_its_partial_sum_comes_from_its_first_addition():
    model = _seq(Par)
    patch_residuals(model, method="rescontroller", example_input=SEQ, backend="torch-eager")
    block = model[1]
    final = [s for s in merge_sites(block)]
    assert len(final) == 1
    with pytest.raises(RuntimeError, match="parallel block"):
        final[0](SEQ, SEQ)  # called without the block's first addition


@pytest.mark.parametrize("method", ["rescontroller", "mgr"])
def test_patched_parallel_block_survives_deepcopy_and_pickle(method):
    """The parts and the last site of a block share their per-forward state; copies share their own."""
    model = _seq(Par)
    patch_residuals(model, method=method, example_input=SEQ, backend="torch-eager")
    ref = model(SEQ)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    for twin in (copy.deepcopy(model), torch.load(buf, weights_only=False)):
        parts = [m for m in twin.modules() if type(m).__name__ == "ParallelPart"]
        (site,) = merge_sites(twin[1])
        assert len(parts) == 2 and parts[0]._run is site.parallel is not merge_sites(model[1])[0].parallel
        assert torch.equal(twin(SEQ), ref)


# ---------------------------------------------------------------------------------------------- MoE
class MoE(nn.Module):
    """Top-1 mixture of experts filling its output with one kind of write per expert."""

    def __init__(self, write: str, experts: int = 3):
        super().__init__()
        self.write = write
        self.gate = nn.Linear(C, experts)
        self.experts = nn.ModuleList(_mlp() for _ in range(experts))

    def forward(self, x):
        B, T, _ = x.shape
        x = x.reshape(-1, C)
        probs, idx = self.gate(x).softmax(-1).topk(1)
        y = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok = torch.where(idx[:, 0] == e)[0]
            v = probs[tok] * expert(x[tok])
            if self.write == "index_iadd":          # LitGPT's LLaMAMoE
                y[tok] += v
            elif self.write == "setitem":
                y[tok] = v
            elif self.write == "index_put_":
                y.index_put_((tok,), v, accumulate=True)
            elif self.write == "index_add_":
                y.index_add_(0, tok, v)
            elif self.write == "masked_scatter_":
                mask = (idx[:, 0] == e)[:, None].expand(-1, C)
                y.masked_scatter_(mask, v)
            elif self.write == "scatter_add_":
                y.scatter_add_(0, tok[:, None].expand(-1, C), v)
            elif self.write == "view_index_add_":   # written through a view of y
                flat = (tok[:, None] * C + torch.arange(C)).reshape(-1)
                y.view(-1).index_add_(0, flat, v.reshape(-1))
            elif self.write == "slice_iadd":        # a basic-indexing view, then setitem
                y[:, :] += probs * expert(x) * (idx == e)
            else:
                raise ValueError(self.write)
        return y.view(B, T, C)


class MoEBlock(nn.Module):
    def __init__(self, write):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.attn, self.moe = nn.Linear(C, C), MoE(write)

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        return x + self.moe(self.n2(x))


WRITES = ["index_iadd", "setitem", "index_put_", "index_add_", "masked_scatter_", "scatter_add_",
          "view_index_add_", "slice_iadd"]


@pytest.mark.parametrize("write", WRITES)
def test_moe_written_by_indexed_inplace_writes_is_a_merge(write):
    model = _seq(lambda: MoEBlock(write))
    report = add_and_unpatch_are_bitwise(model, SEQ)
    assert [c.length for c in report.chains] == [4]
    assert [s.branch for s in report.sites] == ["attn", "mlp"] * 2
    assert [s.source_line for s in report.sites][1::2] == ["return x + self.moe(self.n2(x))"] * 2
    m = _seq(lambda: MoEBlock(write))
    patch_residuals(m, method="mgr", example_input=SEQ, backend="torch-eager")
    m(SEQ).pow(2).mean().backward()
    assert all(p.grad is not None for p in m[1].moe.experts.parameters())


@pytest.mark.parametrize("method", ["mgr-competitive"])
def test_parallel_blocks_checkpointed_as_the_strategy_does_train_as_written(method):
    """The strategy's checkpoint (``wrap_blocks``: ``checkpoint_block``) around parallel blocks, whose first
    addition is a ``ParallelPart`` (a run of its own, not a chain's): the step equals the model not checkpointed."""
    from lightning_resctl.distributed.recipe import wrap_blocks

    model = _seq(Par)
    patch_residuals(model, method=method, example_input=SEQ, backend="torch-eager", invert=False)
    ref = copy.deepcopy(model)
    wrap_blocks(model, [("1", model[1]), ("2", model[2])], "blocks", None)
    for m in (model, ref):
        m(SEQ).pow(2).mean().backward()
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()}
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=0, atol=0, msg=name)
