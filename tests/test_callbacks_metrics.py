"""Per-depth metric math (lightning_resctl.diagnostics.metrics) and the plotting helpers
(lightning_resctl.diagnostics.plots)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lightning_resctl.diagnostics.metrics import GradStats, StreamStats, histogram_median
from lightning_resctl.diagnostics.plots import curves_figure, figure_to_array, heatmap_figure
from lightning_resctl.rules.mgr.stats import MGRStats
from lightning_resctl.rules.rescontroller import rescontroller_scales
from lightning_resctl.rules.rescontroller.stats import ControllerStats


def _rms(t):
    return t.double().pow(2).mean().sqrt().item()


def test_stream_stats_match_direct_computation():
    m = StreamStats(3, chain_starts=[0, 0, 2])
    xs = [torch.randn(4, 7, 16) * s for s in (1.0, 3.0, 0.5)]
    us = [torch.randn(4, 7, 16) * s for s in (0.1, 0.2, 0.3)]
    for d in range(3):
        m.update(d, xs[d], us[d])
    out = m.compute()
    for d in range(3):
        assert out["stream_rms"][d].item() == pytest.approx(_rms(xs[d]), rel=1e-6)
        assert out["update_rms"][d].item() == pytest.approx(_rms(us[d]), rel=1e-6)
        assert out["update_ratio"][d].item() == pytest.approx(_rms(us[d]) / _rms(xs[d]), rel=1e-6)
        assert out["max_abs"][d].item() == pytest.approx(xs[d].abs().max().item(), rel=1e-6)
        med = xs[d].abs().flatten().double().quantile(0.5).item()
        ratio = xs[d].abs().max().item() / med
        # median read off a log2 histogram with 16 bins per octave: within one bin (2**(1/16) ~ 4.4%)
        assert out["max_over_median"][d].item() == pytest.approx(ratio, rel=0.045)
    assert out["growth"][0].item() == pytest.approx(1.0)
    assert out["growth"][1].item() == pytest.approx(_rms(xs[1]) / _rms(xs[0]), rel=1e-6)
    assert out["growth"][2].item() == pytest.approx(1.0)  # its own chain start


def test_unobserved_depth_is_nan_and_depth_checked():
    m = StreamStats(2)
    m.update(1, torch.ones(3, 4))
    out = m.compute()
    assert math.isnan(out["stream_rms"][0].item()) and out["stream_rms"][1].item() == 1.0
    assert math.isnan(out["update_rms"][1].item())
    with pytest.raises(ValueError, match="depth"):
        m.update(2, torch.ones(1))
    with pytest.raises(ValueError, match="num_depths"):
        StreamStats(0)


def test_histogram_median_exact_on_bin_edges():
    # 3 values on exact powers of two -> median 2**1 (middle), interpolation inside its bin
    vals = torch.tensor([1.0, 2.0, 4.0, 1024.0, 0.25])
    m = StreamStats(1)
    m.update(0, vals)
    med = histogram_median(m.abs_hist)[0].item()
    assert med == pytest.approx(2.0, rel=0.045)


@pytest.mark.parametrize("cls,kw", [(StreamStats, {}), (ControllerStats, {}), (MGRStats, {"streams": 3}),
                                    (GradStats, {})])
def test_reduced_states_equal_union_of_data(cls, kw):
    """Merging two 'ranks' with each state's dist_reduce_fx == one metric fed the union."""
    torch.manual_seed(1)
    a, b, union = cls(2, **kw), cls(2, **kw), cls(2, **kw)
    for part in (a, b):
        for d in range(2):
            x = torch.randn(5, 3, 8) * (d + 1)
            u = torch.randn(5, 3, 8)
            if cls is StreamStats:
                args = [(d, x, u)]
            elif cls is ControllerStats:
                args = [(d, rescontroller_scales(x, u))]
            elif cls is MGRStats:
                beta = torch.softmax(torch.randn(5, 3, 4), -1)[..., 1:]
                args = [(d, x, beta, torch.rand(5, 3), torch.softmax(torch.randn(5, 3, 3), -1))]
            else:
                args = [(d, u)]
                part.update(d, param_sumsq=u.pow(2).sum(), param_count=u.numel())
                union.update(d, param_sumsq=u.pow(2).sum(), param_count=u.numel())
            for arg in args:
                part.update(*arg)
                union.update(*arg)
    a.merge_state(b)
    ra, ru = a.compute(), union.compute()
    assert ra.keys() == ru.keys()
    for k in ra:
        torch.testing.assert_close(ra[k], ru[k], equal_nan=True, rtol=1e-10, atol=1e-12)
        assert torch.isfinite(ru[k]).any(), k


def test_controller_cap_fractions():
    torch.manual_seed(0)
    r = torch.randn(6, 9, 32)
    m = ControllerStats(2)
    m.update(0, rescontroller_scales(r, 10.0 * r))  # update far above 0.18 x stream: both caps clamp
    m.update(1, rescontroller_scales(r, 0.01 * torch.randn_like(r)))  # tiny update: idle
    out = m.compute()
    assert out["update_cap_frac"].tolist() == [1.0, 0.0]
    assert out["stream_cap_frac"].tolist() == [1.0, 0.0]
    assert out["alpha_mean"][0] < 0.1 and out["alpha_mean"][1].item() == pytest.approx(1.0, abs=1e-3)


def test_mgr_stats_values():
    n, C = 3, 8
    streams = torch.randn(4, 5, n, C)
    beta = torch.rand(4, 5, n)
    forget = torch.rand(4, 5)
    pool = torch.full((4, 5, n), 1.0 / n)
    m = MGRStats(2, n)
    m.update(1, streams=streams, beta=beta, forget=forget, pool=pool)
    m.update(0, streams=streams[..., :1, :])  # accumulating merge: one stream so far
    out = m.compute()
    torch.testing.assert_close(out["gate_mean"][1], beta.double().mean((0, 1)))
    torch.testing.assert_close(out["gate_std"][1], beta.double().reshape(-1, n).std(0, unbiased=False))
    assert out["forget_mean"][1].item() == pytest.approx(forget.double().mean().item())
    assert out["pool_entropy"][1].item() == pytest.approx(math.log(n))
    torch.testing.assert_close(out["stream_rms"][1], streams.double().pow(2).mean((0, 1, 3)).sqrt())
    unit = torch.nn.functional.normalize(streams.double(), dim=-1)
    angles = [torch.acos((unit[..., i, :] * unit[..., j, :]).sum(-1).clamp(-1, 1))
              for i in range(n) for j in range(i + 1, n)]
    assert out["angle"][1].item() == pytest.approx(torch.stack(angles).mean().item(), rel=1e-9)
    assert math.isnan(out["angle"][0].item())  # one stream: no pair
    assert torch.isnan(out["stream_rms"][0, 1:]).all() and torch.isfinite(out["stream_rms"][0, 0])
    assert m.beta_hist[1].sum(-1).tolist() == [20.0] * n


def test_grad_stats():
    g = GradStats(2)
    g.update(0, torch.full((3, 4), 2.0))
    g.update(1, param_sumsq=9.0, param_count=4)
    out = g.compute()
    assert out["stream_grad_rms"][0].item() == 2.0 and out["param_grad_rms"][1].item() == 1.5
    assert math.isnan(out["param_grad_rms"][0].item())


def test_plots_render_chw_uint8():
    fig = curves_figure({"a": ([0, 1, 2], [1.0, 2.0, float("nan")]), "b": (np.arange(3), np.ones(3))},
                        "depth", "rms", "t", logy=True)
    arr = figure_to_array(fig)
    assert arr.dtype == np.uint8 and arr.ndim == 3 and arr.shape[0] == 3 and arr.std() > 0
    arr2 = figure_to_array(heatmap_figure(torch.rand(4, 6), "step", "depth", "h",
                                          xticks=list(range(6)), yticks=list(range(4))))
    assert arr2.shape[0] == 3 and arr2.std() > 0
    with pytest.raises(ValueError, match="two-dimensional"):
        heatmap_figure(np.zeros(3))
    with pytest.raises(ValueError, match="xs has"):
        curves_figure({"a": ([0, 1], [1.0])})
    with pytest.raises(TypeError, match="Figure"):
        figure_to_array("nope")


def test_heatmap_fixed_log_range_does_not_follow_the_data():
    a = heatmap_figure(np.array([[1.0, 2.0], [3.0, 4.0]]), vmin=1e-2, vmax=1e2, log=True)
    b = heatmap_figure(np.array([[100.0, 200.0], [0.5, 0.7]]), vmin=1e-2, vmax=1e2, log=True)
    for fig in (a, b):
        norm = fig.axes[0].images[0].norm
        assert (norm.vmin, norm.vmax) == (1e-2, 1e2) and type(norm).__name__ == "LogNorm"
    with pytest.raises(ValueError, match="vmin"):
        heatmap_figure(np.ones((2, 2)), vmin=0.0, vmax=1.0, log=True)


def test_curves_kinds_marker_and_legend():
    fig = curves_figure({"rms": ([0, 1, 2, 3], [1.0, 2.0, 3.0, 4.0])}, kinds=["attn", "mlp", "attn", "mlp"])
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend == ["rms", "attn merge", "mlp merge"]
    markers = {tuple(l.get_xdata()): l.get_marker() for l in fig.axes[0].lines if len(l.get_xdata())}
    assert markers[(0, 2)] == "o" and markers[(1, 3)] == "s"
    plain = curves_figure({"rms": ([0, 1], [1.0, 2.0])}, kinds=["", ""])
    assert [t.get_text() for t in plain.axes[0].get_legend().get_texts()] == ["rms"]
    with pytest.raises(ValueError, match="kinds"):
        curves_figure({"rms": ([0, 1], [1.0, 2.0])}, kinds=["attn"])
