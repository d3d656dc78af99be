"""ResidualControlCallback / ResidualAblationCallback in single-process Lightning runs.

Every test reads the written TensorBoard event files back and checks tags, depths and values.
"""
from __future__ import annotations

import copy
import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tbparse import SummaryReader
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_resctl.callbacks import ResidualAblationCallback, ResidualControlCallback
from lightning_resctl.surgery import get_patch_report, merge_sites
from models import NanoGPT

CFG = dict(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
FAMILIES = ("stream_rms", "update_rms", "update_ratio", "growth", "max_abs", "max_over_median",
            "stream_grad_rms", "param_grad_rms")


def _tokens(n=8, seed=123):
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, CFG["vocab_size"], (n, CFG["block_size"] + 1), generator=g)
    return TensorDataset(tok[:, :-1], tok[:, 1:])


class LitGPT(L.LightningModule):
    def __init__(self, lr=0.1, build=True):
        super().__init__()
        self.model = NanoGPT(**CFG) if build else None
        self.lr = lr
        self.example_input_array = torch.randint(0, CFG["vocab_size"], (2, CFG["block_size"]))

    def forward(self, idx):
        return self.model(idx)

    def loss(self, batch):
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("val_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class BuildInConfigure(LitGPT):
    def __init__(self):
        super().__init__(build=False)

    def configure_model(self):
        if self.model is None:
            self.model = NanoGPT(**CFG)


def _trainer(tmp_path, callbacks, *, name="run", logger=None, **kw):
    opts = dict(
        accelerator="cpu", devices=1, max_steps=2, log_every_n_steps=1, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        default_root_dir=str(tmp_path),
    )
    opts.update(kw)
    logger = logger if logger is not None else TensorBoardLogger(str(tmp_path), name=name, version=0)
    return L.Trainer(logger=logger, callbacks=callbacks, **opts)


def _loader(n=8, batch=4, seed=123):
    return DataLoader(_tokens(n, seed), batch_size=batch, shuffle=False)


def _scalars(logdir):
    df = SummaryReader(str(logdir), pivot=False).scalars
    return {(r.tag, int(r.step)): float(r.value) for r in df.itertuples()}


def _acc(logdir):
    acc = EventAccumulator(str(logdir), size_guidance={"images": 0, "histograms": 0, "tensors": 0, "scalars": 0})
    acc.Reload()
    return acc


def _rms(t):
    return t.detach().double().pow(2).mean().sqrt().item()


def _reference_stats(model: NanoGPT, batch):
    """Stream / update RMS and gradient RMS per merge from forward hooks on an unpatched copy."""
    streams, updates, sgrads = {}, {}, {}
    hooks = []

    def keep_stream(d):
        def pre(mod, args):
            x = args[0]
            streams[d] = x
            if x.requires_grad:
                x.register_hook(lambda g: sgrads.__setitem__(d, g))
        return pre

    def keep_update(d):
        return lambda mod, args, out: updates.__setitem__(d, out)

    for i, block in enumerate(model.h):
        hooks.append(block.ln_1.register_forward_pre_hook(keep_stream(2 * i)))
        hooks.append(block.attn.register_forward_hook(keep_update(2 * i)))
        hooks.append(block.ln_2.register_forward_pre_hook(keep_stream(2 * i + 1)))
        hooks.append(block.mlp.register_forward_hook(keep_update(2 * i + 1)))
    x, y = batch
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    for h in hooks:
        h.remove()
    pgrad = {}
    for i, block in enumerate(model.h):
        for d, mods in ((2 * i, (block.ln_1, block.attn)), (2 * i + 1, (block.ln_2, block.mlp))):
            g = torch.cat([p.grad.flatten() for m in mods for p in m.parameters()])
            pgrad[d] = _rms(g)
    return ({d: _rms(t) for d, t in streams.items()}, {d: _rms(t) for d, t in updates.items()},
            {d: _rms(t) for d, t in sgrads.items()}, pgrad)


class _ObserverProbe(L.Callback):
    """Listed after the control callback: records whether observers are set at each batch start."""

    def __init__(self):
        self.set_at = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.set_at.append(any(s.observer is not None for s in merge_sites(pl_module)))


def test_observe_unpatched_model_values_tags_layout_images(tmp_path):
    module = LitGPT()
    cb = ResidualControlCallback(per_depth="all", log_every_n_steps=2)
    probe = _ObserverProbe()
    trainer = _trainer(tmp_path, [cb, probe], max_steps=4, max_epochs=2, limit_train_batches=2,
                       limit_val_batches=1)
    trainer.fit(module, _loader(), _loader(n=4, seed=7))

    # observers only on logging steps (batches_that_stepped + 1 divisible by 2), none after fit
    assert probe.set_at == [False, True, False, True]
    assert get_patch_report(module) is None and not merge_sites(module)  # the "add" patch was removed

    logdir = tmp_path / "run" / "version_0"
    sc = _scalars(logdir)
    steps = sorted({s for (t, s) in sc if t.startswith("resctl/stream_rms/")})
    assert steps == [1, 3]  # Lightning's own logging steps for log_every_n_steps=2
    for fam in FAMILIES:
        for d in range(4):
            v = sc[(f"resctl/{fam}/{d:02d}", 1)]
            assert math.isfinite(v) and v > 0, (fam, d, v)
    # values against independent hooks: test_first_step_values_equal_independent_hooks; here the structure
    for d in range(4):
        assert sc[("resctl/update_ratio/%02d" % d, 1)] == pytest.approx(
            sc[("resctl/update_rms/%02d" % d, 1)] / sc[("resctl/stream_rms/%02d" % d, 1)], rel=1e-5)
    assert sc[("resctl/growth/00", 1)] == pytest.approx(1.0)

    acc = _acc(logdir)
    images = acc.Tags()["images"]
    for tag in ("resctl/depth_profile/rms", "resctl/depth_profile/ratio", "resctl/depth_heatmap/stream_rms",
                "resctl/depth_heatmap/update_ratio"):
        assert tag in images, images
    assert "custom_scalars__config__" in acc.Tags()["tensors"]
    from tensorboard.plugins.custom_scalar import layout_pb2

    layout = layout_pb2.Layout()
    layout.ParseFromString(acc.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    charts = {c.title: list(c.multiline.tag) for cat in layout.category for c in cat.chart}
    assert set(FAMILIES) <= set(charts)
    assert charts["stream_rms"] == [r"^resctl/stream_rms/\d+$"]

    assert len(cb.depth_profile["stream_rms"]) == 4
    assert cb.depth_profile["stream_rms"] == pytest.approx([sc[(f"resctl/stream_rms/{d:02d}", 3)] for d in range(4)])


def test_first_step_values_equal_independent_hooks(tmp_path):
    module = LitGPT()
    reference = copy.deepcopy(module.model)
    ref_stream, ref_update, ref_sgrad, ref_pgrad = _reference_stats(reference, next(iter(_loader())))
    cb = ResidualControlCallback(per_depth="all", log_every_n_steps=1, depth_images=False)
    _trainer(tmp_path, [cb], max_steps=1).fit(module, _loader())
    sc = _scalars(tmp_path / "run" / "version_0")
    for d in range(4):
        assert sc[(f"resctl/stream_rms/{d:02d}", 0)] == pytest.approx(ref_stream[d], rel=1e-5)
        assert sc[(f"resctl/update_rms/{d:02d}", 0)] == pytest.approx(ref_update[d], rel=1e-5)
        assert sc[(f"resctl/growth/{d:02d}", 0)] == pytest.approx(ref_stream[d] / ref_stream[0], rel=1e-5)
        assert sc[(f"resctl/stream_grad_rms/{d:02d}", 0)] == pytest.approx(ref_sgrad[d], rel=1e-4)
        # branch parameters of merge 2i: ln_1 + attn of block i; of merge 2i+1: ln_2 + mlp
        assert sc[(f"resctl/param_grad_rms/{d:02d}", 0)] == pytest.approx(ref_pgrad[d], rel=1e-4)
    assert cb.depth_profile["stream_rms"] == pytest.approx([ref_stream[d] for d in range(4)], rel=1e-5)


class CapNet(L.LightningModule):
    """One merge x + branch(x) with branch(x) = 0.01 x + 1: tiny x -> the update cap clamps every row,
    huge x -> no cap is active."""

    def __init__(self, dim=16):
        super().__init__()
        self.inp = nn.Identity()
        self.branch = nn.Linear(dim, dim)
        with torch.no_grad():
            self.branch.weight.copy_(0.01 * torch.eye(dim))
            self.branch.bias.fill_(1.0)
        self.example_input_array = torch.randn(3, dim)

    def forward(self, x):
        h = self.inp(x)
        return h + self.branch(h)

    def training_step(self, batch, batch_idx):
        return self(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_rescontroller_cap_fraction(tmp_path):
    x = torch.cat([0.01 * torch.randn(8, 16), 100.0 * torch.randn(8, 16)])
    loader = DataLoader(TensorDataset(x), batch_size=8, shuffle=False)
    cb = ResidualControlCallback(per_depth="all", method="rescontroller", log_every_n_steps=1)
    module = CapNet()
    _trainer(tmp_path, [cb], max_steps=2).fit(module, loader)
    assert get_patch_report(module) is not None  # method given: stays patched
    sc = _scalars(tmp_path / "run" / "version_0")
    assert sc[("resctl/update_cap_frac/00", 0)] == 1.0
    assert sc[("resctl/update_cap_frac/00", 1)] == 0.0
    assert sc[("resctl/stream_cap_frac/00", 1)] == 0.0
    assert sc[("resctl/alpha_mean/00", 0)] < 0.1 and sc[("resctl/alpha_mean/00", 1)] == pytest.approx(1.0, abs=1e-3)
    assert math.isfinite(sc[("resctl/beta_mean/00", 0)])


def test_mgr_gate_families_and_histograms(tmp_path):
    cb = ResidualControlCallback(per_depth="all", method="mgr", log_every_n_steps=1, streams=2)
    module = LitGPT()
    _trainer(tmp_path, [cb], max_steps=2).fit(module, _loader())
    logdir = tmp_path / "run" / "version_0"
    sc = _scalars(logdir)
    # 4 merges, 2 streams: merge 0 accumulates, merges 1..3 are gated
    for d in (1, 2, 3):
        for fam in ("mgr_gate_mean_s0", "mgr_gate_mean_s1", "mgr_gate_std_s0", "mgr_forget_mean",
                    "mgr_pool_entropy", "mgr_stream_rms_s0", "mgr_stream_rms_s1", "mgr_angle"):
            v = sc[(f"resctl/{fam}/{d:02d}", 1)]
            assert math.isfinite(v), (fam, d)
        g0, g1, f = (sc[(f"resctl/{k}/{d:02d}", 1)] for k in ("mgr_gate_mean_s0", "mgr_gate_mean_s1",
                                                               "mgr_forget_mean"))
        assert 0 < g0 < 1 and 0 < g1 < 1 and 0 < f < 1
        assert g0 + g1 + f == pytest.approx(1.0, abs=1e-6)  # competitive gating: a softmax over forget + streams
    assert ("resctl/mgr_gate_mean_s0/00", 1) not in sc  # accumulating merge has no gate
    assert math.isfinite(sc[("resctl/stream_rms/00", 1)])
    hist = _acc(logdir).Tags()["histograms"]
    assert {"resctl/mgr_gate_hist_s0/01", "resctl/mgr_gate_hist_s1/03"} <= set(hist)


def test_logger_without_images_gets_scalars(tmp_path):
    cb = ResidualControlCallback(per_depth="all", log_every_n_steps=1)
    logger = CSVLogger(str(tmp_path), name="csv", version=0)
    _trainer(tmp_path, [cb], logger=logger, max_steps=2, limit_val_batches=1, max_epochs=1,
             limit_train_batches=2).fit(LitGPT(), _loader(), _loader(n=4))
    import csv

    rows = list(csv.DictReader(open(tmp_path / "csv" / "version_0" / "metrics.csv")))
    vals = [float(r["resctl/stream_rms/03"]) for r in rows if r.get("resctl/stream_rms/03")]
    assert len(vals) == 2 and all(math.isfinite(v) for v in vals)


def test_ablation_matches_manual_skip(tmp_path):
    ctrl = ResidualControlCallback(per_depth="all", method="add", log_every_n_steps=1, depth_images=False)
    abl = ResidualAblationCallback(every_n_epochs=1, max_batches=2)
    module = LitGPT()
    val = _loader(n=12, batch=4, seed=5)
    _trainer(tmp_path, [ctrl, abl], max_epochs=1, limit_train_batches=2, limit_val_batches=3).fit(
        module, _loader(), val)
    assert len(abl.loss_increase) == 4 and all(math.isfinite(v) for v in abl.loss_increase)

    batches = list(val)[:2]  # max_batches

    def mean_loss():
        with torch.no_grad():
            return sum(module.loss(b).double().item() for b in batches) / len(batches)

    module.eval()
    base = mean_loss()
    assert abl.base_loss == pytest.approx(base, rel=1e-6)
    for d, site in enumerate(merge_sites(module)):
        site.skip_update = True
        expected = mean_loss() - base
        site.skip_update = False
        assert abl.loss_increase[d] == pytest.approx(expected, rel=1e-5, abs=1e-7)
    logdir = tmp_path / "run" / "version_0"
    sc = _scalars(logdir)
    (val_step,) = [s for (t, s) in sc if t == "val_loss"]  # logged at the same step as Lightning's val metrics
    assert [sc[(f"resctl/ablation_loss_increase/{d:02d}", val_step)] for d in range(4)] == pytest.approx(
        abl.loss_increase)
    assert sc[("resctl/ablation_base_loss", val_step)] == pytest.approx(base, rel=1e-6)
    assert "resctl/ablation/loss_increase" in _acc(logdir).Tags()["images"]


def test_swa_listed_before_and_after(tmp_path):
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    for order in ("before", "after"):
        swa = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)
        cb = ResidualControlCallback(per_depth="all", method="mgr", log_every_n_steps=1, depth_images=False, streams=2)
        module = LitGPT()
        cbs = [swa, cb] if order == "before" else [cb, swa]
        _trainer(tmp_path / order, cbs, max_steps=-1, max_epochs=2, limit_train_batches=2).fit(module, _loader())
        avg = swa._average_model
        assert get_patch_report(avg) is not None, order
        assert list(avg.state_dict()) == list(module.state_dict()), order
        # SWA copied the averaged weights (MGR parameters included) into the module at train end
        for (n, p), (n2, q) in zip(module.named_parameters(), avg.named_parameters()):
            assert n == n2 and torch.equal(p, q.to(p.device)), (order, n)
        sc = _scalars(tmp_path / order / "run" / "version_0")
        assert math.isfinite(sc[("resctl/mgr_gate_mean_s0/03", 3)])


def test_model_built_in_configure_model(tmp_path):
    cb = ResidualControlCallback(per_depth="all", method="mgr", log_every_n_steps=1, depth_images=False, streams=2)
    module = BuildInConfigure()
    trainer = _trainer(tmp_path, [cb], max_steps=2)
    trainer.fit(module, _loader())
    report = get_patch_report(module)
    assert report is not None and len(report.sites) == 4
    new = [p for n, p in module.named_parameters() if "_resctl_mgr" in n]
    opt = {id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]}
    assert new and all(id(p) in opt for p in new)
    assert "configure_model" not in vars(module)  # the wrapper is removed at teardown
    assert math.isfinite(_scalars(tmp_path / "run" / "version_0")[("resctl/stream_rms/03", 1)])


def test_checkpoint_resume_restores_patched_weights(tmp_path):
    cb = ResidualControlCallback(per_depth="all", method="mgr", log_every_n_steps=1, depth_images=False, streams=2)
    module = LitGPT()
    trainer = _trainer(tmp_path, [cb], max_steps=2)
    trainer.fit(module, _loader())
    ckpt = tmp_path / "last.ckpt"
    trainer.save_checkpoint(str(ckpt))
    saved = torch.load(ckpt, weights_only=False)["state_dict"]
    assert any("_resctl_mgr" in k for k in saved)

    class Grab(L.Callback):
        def on_train_start(self, trainer, pl_module):
            self.state = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}

    grab = Grab()
    torch.manual_seed(99)  # a different init: restore must overwrite every weight, MGR ones included
    cb2 = ResidualControlCallback(per_depth="all", method="mgr", log_every_n_steps=1, depth_images=False, streams=2)
    _trainer(tmp_path, [cb2, grab], name="resume", max_steps=3).fit(LitGPT(), _loader(), ckpt_path=str(ckpt))
    assert list(grab.state) == list(saved)
    for k, v in saved.items():
        assert torch.equal(grab.state[k], v), k
    sc = _scalars(tmp_path / "resume" / "version_0")
    assert math.isfinite(sc[("resctl/stream_rms/00", 2)])


def test_bad_arguments():
    with pytest.raises(ValueError, match="method"):
        ResidualControlCallback(per_depth="all", method="relu")
    with pytest.raises(ValueError, match="log_every_n_steps"):
        ResidualControlCallback(per_depth="all", log_every_n_steps=0)
    with pytest.raises(ValueError, match="without a method"):
        ResidualControlCallback(per_depth="all", streams=4)
    with pytest.raises(ValueError, match="every_n_epochs"):
        ResidualAblationCallback(every_n_epochs=0)
    with pytest.raises(TypeError, match="loss_fn"):
        ResidualAblationCallback(loss_fn=3)


def test_gradient_accumulation_observes_all_micro_batches(tmp_path):
    module = LitGPT()
    reference = copy.deepcopy(module.model)
    b0, b1 = list(_loader())[:2]
    union = (torch.cat([b0[0], b1[0]]), torch.cat([b0[1], b1[1]]))
    ref_stream, ref_update, ref_sgrad, ref_pgrad = _reference_stats(reference, union)
    cb = ResidualControlCallback(per_depth="all", log_every_n_steps=1, depth_images=False)
    _trainer(tmp_path, [cb], max_steps=1, accumulate_grad_batches=2).fit(module, _loader())
    sc = _scalars(tmp_path / "run" / "version_0")
    assert {s for (t, s) in sc if t.startswith("resctl/")} == {0}
    for d in range(4):
        assert sc[(f"resctl/stream_rms/{d:02d}", 0)] == pytest.approx(ref_stream[d], rel=1e-5)
        assert sc[(f"resctl/update_rms/{d:02d}", 0)] == pytest.approx(ref_update[d], rel=1e-5)
        assert sc[(f"resctl/stream_grad_rms/{d:02d}", 0)] == pytest.approx(ref_sgrad[d], rel=1e-4)
        assert sc[(f"resctl/param_grad_rms/{d:02d}", 0)] == pytest.approx(ref_pgrad[d], rel=1e-4)


class LitBranchy(L.LightningModule):
    """BranchyNet: one expression ``x = x + layer(x)`` runs merges 0 and 4 (a site with two positions)."""

    def __init__(self):
        super().__init__()
        from models import BranchyNet

        self.model = BranchyNet(dim=8, depth=6)
        self.example_input_array = torch.randn(4, 5, 8)

    def forward(self, x):
        return self.model(x)

    def loss(self, batch):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def training_step(self, batch, batch_idx):
        return self.loss(batch)

    def validation_step(self, batch, batch_idx):
        return self.loss(batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_loop_model_positions_values_and_ablation(tmp_path):
    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(8, 5, 8, generator=g), torch.randint(0, 3, (8,), generator=g))
    module = LitBranchy()
    reference = copy.deepcopy(module.model)
    cb = ResidualControlCallback(per_depth="all", log_every_n_steps=1, depth_images=False)
    abl = ResidualAblationCallback(max_batches=2)
    _trainer(tmp_path, [cb, abl], max_epochs=1, max_steps=-1, limit_train_batches=1, limit_val_batches=2).fit(
        module, DataLoader(data, batch_size=4), DataLoader(data, batch_size=4))
    sc = _scalars(tmp_path / "run" / "version_0")

    streams, updates = {}, {}
    hooks = []
    for i, layer in enumerate(reference.layers):
        hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: streams.__setitem__(i, _rms(a[0]))))
        hooks.append(layer.register_forward_hook(lambda m, a, o, i=i: updates.__setitem__(i, _rms(o))))
    with torch.no_grad():
        reference(data.tensors[0][:4])
    for h in hooks:
        h.remove()
    for d in range(6):
        assert sc[(f"resctl/stream_rms/{d:02d}", 0)] == pytest.approx(streams[d], rel=1e-5), d
        assert sc[(f"resctl/update_rms/{d:02d}", 0)] == pytest.approx(updates[d], rel=1e-5), d

    # ablation of merge d == zeroing layer d's output (x + 0 = x), computed independently on the reference
    batches = [(data.tensors[0][i:i + 4], data.tensors[1][i:i + 4]) for i in (0, 4)]

    def mean_loss():
        with torch.no_grad():
            return sum(F.cross_entropy(reference(x), y).double().item() for x, y in batches) / 2

    reference.eval()
    base = mean_loss()
    expected = []
    for layer in reference.layers:
        h = layer.register_forward_hook(lambda m, a, o: torch.zeros_like(o))
        expected.append(mean_loss() - base)
        h.remove()
    assert abl.loss_increase == pytest.approx(expected, rel=1e-5, abs=1e-7)
    assert len(set(round(v, 6) for v in expected)) > 1
