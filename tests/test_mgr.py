"""Multi-Gate Residuals: the torch reference, the chain API, the depth-aware init, the fallback inversion."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_resctl.rules.mgr import (
    MGRChain,
    MGRMerge,
    MGRPool,
    attn_pool_reference,
    mgr_bias_init,
    mgr_gates_reference,
    mgr_merge_reference,
    mgr_step_reference,
)
from lightning_resctl.runtime.memory import saved_tensor_bytes
from mgr_helpers import one_thread  # noqa: F401  (autouse fixture: one intra-op thread)

GATINGS = ("competitive", "independent")


def randomize(chain: MGRChain, query_std=1.0, bias_std=2.0, near_one_every=0, seed=1):
    """Random (not init) parameters; every ``near_one_every``-th gated merge gets gates near 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in chain.named_parameters():
            std = query_std if "query" in name else bias_std
            p.copy_(torch.randn(p.shape, generator=g) * std)
        if near_one_every:
            gated = [m for m in chain.merges if not m.accumulating]
            for m in gated[1::near_one_every]:
                m.gate_bias.fill_(9.0)
                if hasattr(m, "forget_bias"):
                    m.forget_bias.fill_(-9.0)
    return chain


def run_chain(chain, x, weights):
    run = chain.begin(x)
    for w in weights:
        run.write(torch.tanh(run.read() @ w))
    return run.end()


# ------------------------------------------------------------------------------------------- structure
@pytest.mark.parametrize("gating", GATINGS)
def test_parameter_names_and_shapes(gating):
    chain = MGRChain(dim=12, num_merges=6, streams=4, gating=gating)
    assert chain.num_gated == 3 and len(chain.merges) == 6 and isinstance(chain.output_pool, MGRPool)
    for k, m in enumerate(chain.merges):
        assert isinstance(m, MGRMerge) and m.index == k and m.streams == 4 and m.dim == 12
        assert m.accumulating == (k < 3)
        names = {n: tuple(p.shape) for n, p in m.named_parameters()}
        want = {"pool_query": (12,)}
        if k >= 3:
            want.update(gate_query=(12,), gate_bias=(4,))
            if gating == "competitive":
                want["forget_bias"] = (1,)  # 1-d: FSDP2 refuses 0-d parameters
        assert names == want
    assert tuple(chain.output_pool.pool_query.shape) == (12,)


# ------------------------------------------------------------------------------------------- init
@pytest.mark.parametrize("gating", GATINGS)
@pytest.mark.parametrize("n,num_merges", [(2, 22), (4, 27), (8, 40), (4, 9)])
def test_init_uniform_pool_and_depth_aware_gates(gating, n, num_merges):
    c = 16
    chain = MGRChain(c, num_merges, streams=n, gating=gating)
    L = num_merges - (n - 1)
    assert chain.num_gated == L and chain.init_note is None
    target = torch.sigmoid(torch.tensor(-3.0)).item() * math.sqrt(21 / L)
    x = torch.randn(3, 5, c)
    streams, h = chain.start(x)
    assert torch.equal(h, x) and streams.shape == (3, 5, 1, c)
    with torch.no_grad():
        for k in range(num_merges):
            m = streams.shape[-2]
            a = chain.pool_weights(k, streams)
            torch.testing.assert_close(a, torch.full_like(a, 1.0 / m))           # uniform over existing streams
            torch.testing.assert_close(h, streams.mean(-2), rtol=1e-5, atol=1e-6)
            if k >= n - 1:
                beta, forget = chain.gate_values(k, streams)
                torch.testing.assert_close(beta, torch.full_like(beta, target), rtol=1e-5, atol=1e-7)
                if gating == "competitive":
                    torch.testing.assert_close(forget, 1 - beta.sum(-1))
                else:
                    assert forget is None
            streams, h = chain.step(k, streams, torch.randn_like(x) * (k + 1))
        a = chain.pool_weights(num_merges, streams)
        torch.testing.assert_close(a, torch.full_like(a, 1.0 / n))


def test_init_clamp_for_shallow_chains_is_stated():
    # competitive n=8 with L=2: ln(sqrt(2/21)*(e^3+1) - 8) is undefined
    chain = MGRChain(8, 9, streams=8, gating="competitive")
    assert chain.num_gated == 2 and "clamped" in chain.init_note and "beta_init_max" in chain.init_note
    beta, _ = chain.gate_values(7, torch.randn(2, 8, 8))
    torch.testing.assert_close(beta, torch.full_like(beta, 0.5 / 8))
    init = mgr_bias_init(0, 4)
    assert init.note is not None and "no gated merges" in init.note
    assert mgr_bias_init(21, 4, "independent").beta_init == pytest.approx(torch.sigmoid(torch.tensor(-3.0)).item())
    assert MGRChain(8, 2, streams=4).init_note is not None


# ------------------------------------------------------------------------------------------- properties
@pytest.mark.parametrize("gating", GATINGS)
@pytest.mark.parametrize("n", [2, 4, 8])
def test_lerp_never_exceeds_the_larger_norm(gating, n):
    c = 24
    chain = randomize(MGRChain(c, n + 2, streams=n, gating=gating), query_std=3.0, bias_std=3.0, seed=n)
    k = n - 1
    s = torch.randn(64, n, c) * torch.rand(64, n, 1) * 5
    u = torch.randn(64, c) * torch.rand(64, 1) * 5
    with torch.no_grad():
        out, _ = chain.step(k, s, u)
    bound = torch.maximum(s.norm(dim=-1), u.norm(dim=-1, keepdim=True))
    assert (out.norm(dim=-1) <= bound * (1 + 1e-6)).all()
    assert not torch.allclose(out, s)  # the merge did write something


@pytest.mark.parametrize("gating", GATINGS)
def test_deep_chain_stays_bounded_by_largest_update(gating):
    c, n, merges = 32, 4, 48
    chain = randomize(MGRChain(c, merges, streams=n, gating=gating), query_std=1.0, bias_std=1.0)
    x = torch.randn(16, c)
    g = torch.Generator().manual_seed(5)
    us = [torch.randn(16, c, generator=g) * (1 + 0.1 * k) for k in range(merges)]  # growing updates
    with torch.no_grad():
        run = chain.begin(x)
        for u in us:
            run.write(u)
        streams, y = run.streams, run.end()
    largest = torch.stack([x.norm(dim=-1)] + [u.norm(dim=-1) for u in us]).amax(0)  # per token
    assert (streams.norm(dim=-1) <= largest[:, None] * (1 + 1e-5)).all()
    assert (y.norm(dim=-1) <= largest * (1 + 1e-5)).all()
    rms = lambda t: t.pow(2).mean().sqrt()  # noqa: E731
    plain = x + torch.stack(us).sum(0)
    largest_rms = max(rms(u) for u in us)
    assert rms(streams) <= largest_rms and rms(plain) > 3 * largest_rms  # the plain residual chain grows


def test_competitive_gates_sum_below_one():
    c, n = 20, 8
    # fp64: in fp32 a forget gate below 6e-8 rounds the sum to exactly 1
    chain = randomize(MGRChain(c, 10, streams=n, gating="competitive"), query_std=3.0, bias_std=3.0).double()
    s = torch.randn(50, n, c, dtype=torch.float64) * 3
    for k in range(n - 1, 10):
        beta, forget = chain.gate_values(k, s)
        assert (beta.sum(-1) < 1).all() and (forget > 0).all()
        torch.testing.assert_close(beta.sum(-1) + forget, torch.ones(50, dtype=torch.float64))
    beta, forget = chain.gate_values(n - 1, s)
    assert beta.sum(-1).max() > 0.5  # the bound holds where the gates are large too


# ------------------------------------------------------------------------------------------- torch path
@pytest.mark.parametrize("gating", GATINGS)
@pytest.mark.parametrize("n", [2, 4])
def test_torch_path_matches_reference_with_grads(gating, n):
    c, merges = 13, n + 4
    chain = randomize(MGRChain(c, merges, streams=n, gating=gating, invert=False))
    g = torch.Generator().manual_seed(2)
    weights = [torch.randn(c, c, generator=g) / 4 for _ in range(merges)]
    x0 = torch.randn(2, 3, c, generator=g)
    results = {}
    for backend in ("reference", "torch"):
        chain.set_backend(backend)
        chain.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_(True)
        y = run_chain(chain, x, weights)
        (y * torch.linspace(-1, 1, c)).sum().backward()
        results[backend] = [y, x.grad] + [p.grad for p in chain.parameters()]
    for a, b in zip(results["torch"], results["reference"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert chain.merges[0].pool_query.grad is not None and (chain.merges[0].pool_query.grad == 0).all()


@pytest.mark.parametrize("gating", GATINGS)
def test_torch_path_gradcheck_fp64(gating):
    c, n = 5, 3
    chain = randomize(MGRChain(c, 4, streams=n, gating=gating, invert=False, backend="torch")).double()
    k = 3
    s = torch.randn(2, n, c, dtype=torch.float64, requires_grad=True)
    u = torch.randn(2, c, dtype=torch.float64, requires_grad=True)
    m = chain.merges[k]
    params = [m.gate_query, m.gate_bias, chain.output_pool.pool_query] + (
        [m.forget_bias] if gating == "competitive" else [])

    def f(s, u, *ps):
        return chain.step(k, s, u)

    assert torch.autograd.gradcheck(f, (s, u, *params))
    s2 = torch.randn(2, 2, c, dtype=torch.float64, requires_grad=True)  # an accumulating merge
    assert torch.autograd.gradcheck(lambda s, u, w: chain.step(1, s, u), (s2, u, chain.merges[2].pool_query))


def test_autocast_branch_output_is_cast_to_the_streams_dtype():
    chain = MGRChain(16, 3, streams=2)
    x = torch.randn(4, 16)
    lin = nn.Linear(16, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        streams, h = chain.start(x)
        u = lin(h)
        assert u.dtype == torch.bfloat16
        streams, h = chain.step(0, streams, u)
    assert streams.dtype == h.dtype == torch.float32
    torch.testing.assert_close(streams[:, 1], u.float())


def test_bf16_streams_keep_fp32_gate_math():
    c, n = 16, 4
    chain = randomize(MGRChain(c, 6, streams=n, invert="auto"))
    s = torch.randn(8, n, c).bfloat16()
    u = torch.randn(8, c).bfloat16()
    assert not chain.inverts(s) and chain.inverts(s.float())
    out, h = chain.step(4, s, u)
    assert out.dtype == h.dtype == torch.bfloat16
    m = chain.merges[4]
    beta, _ = chain.gate_values(4, s)
    assert beta.dtype == torch.float32
    ref, _ = mgr_merge_reference(s, u, m.gate_query, m.gate_bias, m.forget_bias)
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)
    href, _ = attn_pool_reference(ref, chain.merges[5].pool_query)
    torch.testing.assert_close(h, href, rtol=2e-2, atol=2e-2)


# ------------------------------------------------------------------------------------------- inversion
def grads_of(chain, x0, weights, invert, dtype=torch.float32):
    chain = chain.to(dtype)
    chain.invert = invert
    chain.zero_grad(set_to_none=True)
    x = x0.to(dtype).detach().clone().requires_grad_(True)
    y = run_chain(chain, x, [w.to(dtype) for w in weights])
    (y * torch.cos(torch.arange(y.numel(), dtype=dtype)).reshape(y.shape)).sum().backward()
    return [x.grad.double()] + [p.grad.double() for p in chain.parameters()]


@pytest.mark.parametrize("gating", GATINGS)
@pytest.mark.parametrize("n", [2, 4])
def test_inversion_gradients_match_over_deep_chain(gating, n):
    c, gated = 24, 26
    merges = gated + n - 1
    # the near-one merges need every row saved exactly: a budget of every row (the default budget's overflow:
    # test_inversion_budget_is_spent_on_the_rows_that_need_it)
    chain = randomize(MGRChain(c, merges, streams=n, gating=gating, backend="torch", invert_top_p=1.0),
                      near_one_every=5, seed=n)
    g = torch.Generator().manual_seed(7)
    weights = [torch.randn(c, c, generator=g) / math.sqrt(c) for _ in range(merges)]
    x0 = torch.randn(6, 5, c, generator=g)
    betas = []  # the chain really has gates near 1 and small ones
    with torch.no_grad():
        run = chain.begin(x0)
        for k, w in enumerate(weights):
            if k >= n - 1:
                betas.append(chain.gate_values(k, run.streams)[0])
            run.write(torch.tanh(run.read() @ w))
    betas = torch.stack(betas)
    assert betas.max() > 0.99 and betas.min() < 0.05
    exact = grads_of(chain, x0, weights, False, torch.float64)
    ordinary = grads_of(chain, x0, weights, False)
    inverted = grads_of(chain, x0, weights, True)
    scale = max(e.abs().max() for e in exact)
    for e, o, i in zip(exact, ordinary, inverted):
        torch.testing.assert_close(i, o, rtol=1e-4, atol=1e-5 * scale)
        # as close to the fp64 truth as the ordinary fp32 path
        assert (i - e).abs().max() <= 4 * (o - e).abs().max() + 1e-6 * scale
    total = lambda gs: torch.cat([t.flatten() for t in gs])  # noqa: E731
    assert (total(inverted) - total(ordinary)).norm() <= 1e-5 * total(exact).norm()


def test_inversion_needs_exact_rows_where_gates_are_large():
    # with no exact rows the inversion of gates near 1 is ill-conditioned: the safeguard is what makes it match
    c, n = 16, 2
    chain = randomize(MGRChain(c, 30, streams=n, gating="independent", invert_top_p=0.0, invert_threshold=1.0,
                               invert_max_gain=1e30), near_one_every=3)
    weights = [torch.randn(c, c) / 4 for _ in range(30)]
    x0 = torch.randn(4, c)
    ordinary = grads_of(chain, x0, weights, False)
    unsafe = grads_of(chain, x0, weights, True)
    assert not all(torch.allclose(a, b, rtol=1e-3, atol=1e-4) for a, b in zip(ordinary, unsafe))
    chain.invert_threshold, chain.invert_max_gain, chain.invert_top_p = 0.5, 8.0, 1.0
    safe = grads_of(chain, x0, weights, True)
    for a, b in zip(ordinary, safe):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("n", [4, 8])
def test_inversion_saves_memory(n):
    c, tokens, gated = 256, 256, 24
    merges = gated + n - 1
    weights = [nn.Linear(c, c) for _ in range(merges)]
    x = torch.randn(tokens, c, requires_grad=True)

    def plain():
        h = x
        for lin in weights:
            h = h + lin(h)                           # plain residual add, same branch
        return h

    def mgr(chain):
        run = chain.begin(x)
        for lin in weights:
            run.write(lin(run.read()))
        return run.end()

    def merges_only(chain):                          # branches that save nothing: the merges' own bytes
        run = chain.begin(x)
        for k in range(merges):
            run.write(run.read() * 0.5)
        return run.end()

    plain_bytes, _ = saved_tensor_bytes(plain)
    ordinary = MGRChain(c, merges, streams=n, invert=False)
    inverted = MGRChain(c, merges, streams=n, invert=True)
    ord_bytes, y0 = saved_tensor_bytes(mgr, ordinary)
    inv_bytes, y1 = saved_tensor_bytes(mgr, inverted)
    torch.testing.assert_close(y0, y1)
    row = tokens * c * 4  # one fp32 stream
    ord_merge = saved_tensor_bytes(merges_only, ordinary)[0] / gated / row
    inv_merge = saved_tensor_bytes(merges_only, inverted)[0] / gated / row
    print(f"n={n}: saved per merge (units of one stream) ordinary {ord_merge:.2f}, inverted {inv_merge:.2f}; "
          f"whole chain vs plain residual add: ordinary {ord_bytes / plain_bytes:.2f}x, "
          f"inverted {inv_bytes / plain_bytes:.2f}x")
    assert ord_merge >= n + 1                          # input streams + u per gated merge
    per_row_stats = (6 * 4 * n + n) / (4 * c)  # beta, a, 1/rms and dot products (fp32), mask (bool) per token
    # u + top-p exact rows + the last merge's output + the per-row statistics
    assert inv_merge <= 1 + 0.05 * n + n / gated + per_row_stats + 0.05
    assert ord_merge / inv_merge >= 0.6 * n
    assert (inv_bytes - plain_bytes) <= 0.4 * (ord_bytes - plain_bytes)


def test_inversion_policy_and_errors():
    c = 8
    chain = MGRChain(c, 5, streams=2)
    x = torch.randn(3, c)
    assert chain.inverts(x) and not chain.inverts(x.bfloat16()) and not chain.inverts(x.half())
    with torch.no_grad():
        assert not chain.inverts(x)
    assert not MGRChain(c, 5, streams=2, invert=False).inverts(x)
    # a second backward through the same graph (retain_graph) reconstructs again from the last merge
    chain = randomize(MGRChain(c, 5, streams=2, invert=True))
    xg = x.clone().requires_grad_(True)
    y = chain(xg, [torch.tanh] * 5)
    y.sum().backward(retain_graph=True)
    first = xg.grad.clone()
    y.sum().backward()
    torch.testing.assert_close(xg.grad, 2 * first)
    # streams changed in place between steps are detected instead of silently mis-inverted
    streams, h = chain.start(xg)
    streams, h = chain.step(0, streams, torch.tanh(h))
    s2, h2 = chain.step(1, streams.clone(), torch.tanh(h))  # merge 1 does not claim merge 0's output
    streams.mul_(2)
    with pytest.raises(RuntimeError, match="modified in place"):
        (h2.sum() + s2.sum()).backward()


def test_inversion_steps_aside_for_activation_checkpointing():
    from torch.utils.checkpoint import checkpoint

    c = 12
    chain = randomize(MGRChain(c, 6, streams=3, invert="auto"))
    lins = [nn.Linear(c, c) for _ in range(6)]
    x0 = torch.randn(5, c)

    def block(k, streams, h):
        return chain.step(k, streams, torch.tanh(lins[k](h)))

    def grads(use_checkpoint, reentrant=False):
        chain.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_(True)
        streams, h = chain.start(x)
        for k in range(6):
            if use_checkpoint:
                streams, h = checkpoint(block, k, streams, h, use_reentrant=reentrant)
            else:
                streams, h = block(k, streams, h)
        h.pow(2).sum().backward()
        return [x.grad] + [p.grad for p in chain.parameters()]

    plain = grads(False)
    for reentrant in (False, True):
        for a, b in zip(grads(True, reentrant), plain):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert not chain.inverts(x0)


# ------------------------------------------------------------------------------------------- compile
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_compile_fullgraph_small_model(backend):
    torch._dynamo.reset()
    model = TinyMGRModel(vocab=11, dim=37, layers=2, streams=4, backend=backend)
    idx = torch.randint(0, 11, (2, 5))
    loss = model(idx).logsumexp(-1).mean()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    loss_c = compiled(idx).logsumexp(-1).mean()
    loss_c.backward()
    torch.testing.assert_close(loss_c, loss)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------------------------- hand-written model
class TinyMGRModel(nn.Module):
    """A small transformer whose residual stream is one MGR chain, written by hand with begin/read/write/end."""

    def __init__(self, vocab=16, dim=32, layers=2, streams=4, backend="auto", gating="competitive"):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.attn = nn.ModuleList(nn.MultiheadAttention(dim, 1, batch_first=True, bias=False) for _ in range(layers))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
                                 for _ in range(layers))
        self.ln1 = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.ln2 = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.chain = MGRChain(dim, 2 * layers, streams=streams, gating=gating, backend=backend)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx):
        run = self.chain.begin(self.emb(idx))
        for attn, mlp, ln1, ln2 in zip(self.attn, self.mlp, self.ln1, self.ln2):
            a = ln1(run.read())
            run.write(attn(a, a, a, need_weights=False)[0])
            run.write(mlp(ln2(run.read())))
        return self.head(run.end())


@pytest.mark.parametrize("gating", GATINGS)
def test_hand_written_model_trains(gating):
    model = TinyMGRModel(vocab=8, dim=24, layers=2, streams=4, gating=gating)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    idx = torch.randint(0, 8, (16, 6))
    target = (idx + 1) % 8  # learnable: next symbol
    losses = []
    for _ in range(40):
        loss = nn.functional.cross_entropy(model(idx).reshape(-1, 8), target.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    assert all(p.grad is not None for p in model.chain.parameters())  # every MGR parameter is trained
    assert any(m.gate_query.abs().sum() > 0 for m in model.chain.merges if not m.accumulating)


def test_forward_with_branches_equals_run_api():
    chain = randomize(MGRChain(10, 5, streams=3))
    fs = [nn.Linear(10, 10) for _ in range(5)]
    x = torch.randn(2, 10)
    y = chain(x, fs)
    streams, h = chain.start(x)
    for k, f in enumerate(fs):
        streams, h = chain.step(k, streams, f(h))
    torch.testing.assert_close(y, h)
    torch.testing.assert_close(chain.output_pool(streams), h, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------- diagnostics, errors
def test_diagnostics_and_skip():
    chain = randomize(MGRChain(6, 5, streams=3, gating="independent"))
    x = torch.randn(4, 6)
    streams, h = chain.start(x)
    assert chain.pool_weights(0, streams).shape == (4, 1)
    with pytest.raises(ValueError, match="accumulating"):
        chain.gate_values(0, streams)
    streams, h = chain.step(0, streams, x)
    streams, h = chain.step(1, streams, x)
    beta, forget = chain.gate_values(2, streams)
    m = chain.merges[2]
    ref, _ = mgr_gates_reference(streams, m.gate_query, m.gate_bias, None, "independent")
    assert forget is None and torch.equal(beta, ref)
    s2, h2 = chain.skip(2, streams)
    assert torch.equal(s2, streams)
    torch.testing.assert_close(h2, attn_pool_reference(streams, chain.merges[3].pool_query)[0])


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="streams"):
        MGRChain(8, 4, streams=1)
    with pytest.raises(ValueError, match="gating"):
        MGRChain(8, 4, gating="softmax")
    with pytest.raises(ValueError, match="backend"):
        MGRChain(8, 4, backend="cuda")
    chain = MGRChain(8, 4, streams=2)
    x = torch.randn(3, 8)
    streams, h = chain.start(x)
    with pytest.raises(ValueError, match="x must have shape"):
        chain.start(torch.randn(3, 7))
    with pytest.raises(ValueError, match="streams entering merge 1"):
        chain.step(1, streams, x)                      # merge 1 expects 2 streams
    with pytest.raises(ValueError, match="u must have shape"):
        chain.step(0, streams, torch.randn(3, 9))
    with pytest.raises(TypeError, match="u must be floating point"):
        chain.step(0, streams, x.long())
    with pytest.raises(IndexError, match="k=4"):
        chain.step(4, torch.randn(3, 2, 8), x)
    with pytest.raises(IndexError, match="k=-1"):
        chain.step(-1, streams, x)
    run = chain.begin(x)
    with pytest.raises(RuntimeError, match="ended early"):
        run.end()
    for _ in range(4):
        run.write(run.read())
    with pytest.raises(RuntimeError, match="past its end"):
        run.write(x)
    with pytest.raises(ValueError, match="branches"):
        chain(x, [torch.tanh])


def test_backend_names_shared_with_rescontroller():
    from lightning_resctl.rules.rescontroller import ResController
    from lightning_resctl.runtime import backends

    for name in ("auto", "torch", "triton", "native"):
        chain = MGRChain(8, 4, streams=2, backend=name)
        ctrl = ResController(backend=name)
        assert chain.backend == ctrl.backend == backends.check_backend(name)
    assert MGRChain(8, 4, streams=2, backend="native").backend == "triton"
    with pytest.raises(ValueError, match="backend must be one of"):
        MGRChain(8, 4, streams=2, backend="cuda")
    with pytest.raises(ValueError, match="backend must be one of"):
        ResController(backend="cuda")
    # both rules add the plain-autograd oracle as backend "reference"
    assert MGRChain(8, 4, streams=2, backend="reference").backend == ResController(backend="reference").backend
    with pytest.raises(TypeError, match="backend"):
        MGRChain(8, 4, streams=2, backend=None)


def test_package_layout_keeps_public_names():
    import lightning_resctl.rules.mgr as mgr

    for name in ("MGRChain", "MGRMerge", "MGRPool", "MGRRun", "MGRInit", "attn_pool_reference", "mgr_gates_reference",
                 "mgr_merge_reference", "mgr_step_reference", "mgr_bias_init", "GATINGS", "BACKENDS"):
        assert hasattr(mgr, name), name
    # one home per name: the shared RMS norm lives in rules.common, saved_tensor_bytes in the runtime
    assert not hasattr(mgr, "rms_norm") and not hasattr(mgr, "saved_tensor_bytes")
    assert mgr.MGRChain.__module__ == "lightning_resctl.rules.mgr.modules"
    assert mgr.mgr_step_reference.__module__ == "lightning_resctl.rules.mgr.reference"


@pytest.mark.parametrize("gating", ["competitive", "independent"])
@pytest.mark.parametrize("streams", [2, 4])
def test_meta_init_then_reset_parameters_is_the_normal_init(gating, streams):
    torch.manual_seed(0)
    normal = MGRChain(16, 9, streams=streams, gating=gating)
    with torch.device("meta"):
        meta = MGRChain(16, 9, streams=streams, gating=gating)
    meta = meta.to_empty(device="cpu")
    for p in meta.parameters():
        p.data.fill_(2.2e12)  # what uninitialised memory may hold
    for mod in meta.modules():
        if hasattr(mod, "reset_parameters"):
            mod.reset_parameters()
    want = dict(normal.named_parameters())
    got = dict(meta.named_parameters())
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    gated = [m for m in meta.merges if not m.accumulating]
    assert gated and all(m.gate_bias.abs().max() < 10 for m in gated)


def test_reset_parameters_restores_init_after_training():
    chain = MGRChain(8, 6, streams=3, gating="competitive")
    init = {k: v.clone() for k, v in chain.state_dict().items()}
    with torch.no_grad():
        for p in chain.parameters():
            p.add_(1.0)
    chain.reset_parameters()
    for k, v in chain.state_dict().items():
        torch.testing.assert_close(v, init[k], rtol=0, atol=0)
    pool = MGRPool(5)
    pool.pool_query.data.fill_(3.0)
    pool.reset_parameters()
    assert torch.equal(pool.pool_query, torch.zeros(5))


@pytest.mark.parametrize("kwargs, name", [
    (dict(eps=0.0), "eps"), (dict(eps=-1e-6), "eps"), (dict(eps=float("nan")), "eps"),
    (dict(b_base=float("nan")), "b_base"), (dict(b_base=float("inf")), "b_base"),
    (dict(l_base=0), "l_base"), (dict(l_base=2.5), "l_base"), (dict(l_base=True), "l_base"),
    (dict(beta_init_max=0.0), "beta_init_max"), (dict(beta_init_max=1.0), "beta_init_max"),
    (dict(beta_init_max=float("nan")), "beta_init_max"),
])
def test_chain_options_are_validated(kwargs, name):
    value = next(iter(kwargs.values()))
    with pytest.raises(ValueError, match=rf"{name}.*{value!r}".replace("(", r"\(").replace(")", r"\)")):
        MGRChain(8, 4, streams=2, **kwargs)


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_update_dtype_promotes_like_add(backend):
    chain = randomize(MGRChain(8, 4, streams=2, backend=backend, invert=False))
    x = torch.randn(3, 8)
    s, h = chain.start(x)
    u = torch.randn(3, 8, dtype=torch.float64)
    assert (x + u).dtype == torch.float64
    out, h = chain.step(0, s, u)
    assert out.dtype == h.dtype == torch.result_type(s, u)
    ref, href = mgr_step_reference(s.double(), u, chain.merges[1].pool_query)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(h, href)
    u1 = torch.randn(3, 8)
    out2, h2 = chain.step(1, out, u1)  # fp64 streams + fp32 update stay fp64
    assert out2.dtype == h2.dtype == torch.float64
    ref, href = mgr_step_reference(out, u1.double(), chain.merges[2].pool_query, *chain.merges[1].gate_params(),
                                   gating=chain.gating)
    torch.testing.assert_close(out2, ref)
    torch.testing.assert_close(h2, href)
    # bf16 streams with an fp32 update: fp32, like bf16 + fp32
    sb = out.bfloat16()
    out4, h4 = chain.step(1, sb, torch.randn(3, 8))
    assert out4.dtype == h4.dtype == torch.float32


@pytest.mark.skipif(not __import__("lightning_resctl.runtime.backends").runtime.backends.cpu_compile_available(),
                    reason="no C++ compiler for inductor")
@pytest.mark.parametrize("gating", ["competitive", "independent"])
def test_compiled_torch_path_matches_eager(gating):
    c, n = 24, 3
    results = {}
    for backend in ("torch-eager", "torch-compiled"):
        chain = randomize(MGRChain(c, 5, streams=n, gating=gating, invert=False, backend=backend))
        x = torch.randn(2, 5, c, generator=torch.Generator().manual_seed(3)).requires_grad_()
        w = [torch.randn(c, c, generator=torch.Generator().manual_seed(10 + k)) / c ** 0.5 for k in range(5)]
        y = chain(x, [lambda h, m=m: torch.tanh(h @ m) for m in w])
        (y * torch.cos(torch.arange(y.numel()).reshape(y.shape))).sum().backward()
        results[backend] = [y.detach(), x.grad] + [p.grad for p in chain.parameters()]
    for got, want in zip(results["torch-compiled"], results["torch-eager"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["torch-eager", "torch-compiled"])
@pytest.mark.parametrize("gating", ["independent", "competitive"])
def test_double_backward_is_refused_with_a_clear_error(backend, gating):
    """The fused step's closed-form backward is not differentiable again: a second derivative raises."""
    chain = MGRChain(8, 4, streams=2, gating=gating, backend=backend).double()
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    y = chain(x, [torch.tanh] * 4)
    with pytest.raises(RuntimeError, match="second derivative"):
        torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)


def test_chain_takes_its_options_as_a_config():
    """``MGRChain(dim, num_merges, config=MGRConfig(...))`` builds the chain the keywords build (what the rule
    passes: its own config, not a dict rebuilt into one); keywords and a config together are refused."""
    from lightning_resctl.rules import get_merge_rule
    from lightning_resctl.rules.mgr import MGRConfig

    options = dict(streams=3, gating="independent", invert=False, backend="torch-eager", b_base=-2.0, l_base=7,
                   beta_init_max=0.4, invert_top_p=0.1, invert_threshold=0.6, invert_max_gain=4.0, eps=1e-5)
    by_keywords = MGRChain(8, 5, **options)
    by_config = MGRChain(8, 5, config=MGRConfig(**options))
    assert repr(by_config) == repr(by_keywords)
    for name in options:
        assert getattr(by_config, name) == getattr(by_keywords, name), name
    sd_k, sd_c = by_keywords.state_dict(), by_config.state_dict()
    assert sd_k.keys() == sd_c.keys() and all(torch.equal(sd_k[k], sd_c[k]) for k in sd_k)
    with pytest.raises(TypeError, match="config="):
        MGRChain(8, 5, streams=3, config=MGRConfig(streams=3))
    with pytest.raises(ValueError, match="streams"):
        MGRChain(8, 5, config=MGRConfig(streams=1))
    rule = get_merge_rule("mgr").rule_class("mgr", MGRConfig(**options))
    assert repr(rule.build_chain(8, 5)) == repr(by_keywords)
