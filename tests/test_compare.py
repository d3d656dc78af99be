"""The main job end to end at a tiny size, plus its data, statistics and configuration pieces."""
from __future__ import annotations

import json
import math
import re
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_resctl import compare
from lightning_resctl.compare import CompareConfig, _stats, _verdict, parse_config, run_comparison
from lightning_resctl.data import CharDataModule, CharVocab, hf_corpus, stdlib_corpus, text_corpus

ALL = ["plain", "add", "rescontroller", "mgr-independent", "mgr-competitive"]
PNGS = ["val_loss.png", "stream_rms_depth.png", "update_ratio_depth.png", "ablation_depth.png"]


def _tiny_text(path: Path) -> Path:
    # real, varied text: a slice of a standard-library module's source
    src = Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py"
    path.write_text(src.read_text(encoding="utf-8")[:12000])
    return path


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compare")
    text = _tiny_text(tmp / "corpus.txt")
    out = tmp / "out"
    argv = ["--text", str(text), "--n-layer", "2", "--n-embd", "16", "--n-head", "2", "--block-size", "16",
            "--batch-size", "4", "--steps", "6", "--eval-every", "3", "--val-batches", "2", "--seeds", "2",
            "--methods", ",".join(ALL), "--log-every-n-steps", "2", "--ablation-batches", "1",
            "--warmup-steps", "2", "--progress-bar", "false", "--accelerator", "cpu", "--out", str(out),
            "--threads", "1", "--depth-images", "false", "--cost-steps", "2", "--cost-warmup", "1"]  # tiny ops: one thread avoids OpenMP overhead on a shared CPU
    cfg = parse_config(argv)
    summary = run_comparison(cfg)
    return cfg, out, summary


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def test_pipeline_writes_summary_and_plots_with_finite_numbers(pipeline):
    cfg, out, summary = pipeline
    md = (out / "summary.md").read_text()
    data = json.loads((out / "summary.json").read_text())
    assert set(data["methods"]) == set(ALL)
    depth = 2 * cfg.n_layer
    for m in ALL:
        s = data["methods"][m]
        for key in ("final_val_loss", "final_train_loss", "tokens_per_s"):
            assert s[key]["n"] == 2, (m, key)
            assert _finite(s[key]["mean"]) and _finite(s[key]["spread"]), (m, key, s[key])
        assert s["final_val_loss"]["mean"] > 0
        # cost vs plain: measured side by side in one process, for every method, plain exactly 1
        assert _finite(s["cost_vs_plain"]) and s["cost_vs_plain"] > 0, (m, s["cost_vs_plain"])
        assert len(data["cost"]["ratios"][m]) == 2 and _finite(s["step_s"]) and s["step_s"] > 0
        assert s["description"], m
        assert _finite(s["stream_rms_last_over_first"]) and s["stream_rms_last_over_first"] > 0, m
        assert _finite(s["max_activation_ratio"]) and s["max_activation_ratio"] >= 1.0, m
        for family in ("stream_rms", "update_ratio"):
            prof = s["profiles"][family]
            assert prof is not None and len(prof) == depth and all(map(_finite, prof)), (m, family, prof)
        abl = s["ablation_loss_increase"]
        assert abl is not None and len(abl) == depth and all(map(_finite, abl)), (m, abl)
        steps, values = s["val_curve"]
        assert steps == [3, 6] and all(map(_finite, values)), (m, s["val_curve"])
        # the summary's table row for the method holds finite numbers (no 'nan' / 'n/a')
        row = [line for line in md.splitlines() if line.startswith(f"| {m} |")][1]  # [0]: the methods table
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 9, row
        assert not re.search(r"\bnan\b|n/a|inf", row), row
        numbers = [float(x.replace(",", "")) for x in re.findall(r"-?[\d,]*\.?\d+(?:e[-+]?\d+)?", row)]
        assert len(numbers) >= 10 and all(map(math.isfinite, numbers)), row
    # parameters added: none for plain / add / ResController; MGR's queries and gates otherwise
    assert data["methods"]["plain"]["cost_vs_plain"] == 1.0
    header = next(line for line in md.splitlines() if line.startswith("| method | final val loss"))
    assert "cost vs plain" in header and "tokens/s" in header
    assert header.index("cost vs plain") < header.index("tokens/s")  # raw tokens/s is the secondary column
    assert json.loads((out / "cost.json").read_text())["rounds"] == 2
    params = {m: data["methods"][m]["params_added"] for m in ALL}
    assert params["plain"] == params["add"] == params["rescontroller"] == 0
    assert params["mgr-independent"] > 0 and params["mgr-competitive"] > params["mgr-independent"]
    # one plain-language verdict per non-plain method
    for m in ALL[1:]:
        line = next(line for line in md.splitlines() if line.startswith(f"- **{m}**"))
        assert "validation loss" in line and ("seed spread" in line), line
    # plots: real PNG images with content, and the summary links them
    for name in PNGS:
        path = out / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        import matplotlib.image

        img = matplotlib.image.imread(path)
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100 and np.isfinite(img).all()
        assert float(img[..., :3].std()) > 0.01, f"{name} is blank"
        assert f"({name})" in md
    assert set(summary["files"]) >= {"summary_md", "summary_json", "val_loss_png", "stream_rms_png",
                                      "update_ratio_png", "ablation_png"}


def test_every_run_has_tensorboard_logs_and_matched_data(pipeline):
    cfg, out, _ = pipeline
    for m in ALL:
        for seed in (0, 1):
            run_dir = out / "tb" / m / f"seed{seed}"
            assert list(run_dir.glob("events.out.tfevents.*")), run_dir
            run = json.loads((out / "runs" / f"{m}_seed{seed}.json").read_text())
            assert run["steps"] == cfg.steps and len(run["train_curve"]) == cfg.steps
    # "add" rewrites every merge into the same addition: with the same seed, data order and optimiser
    # its training must reproduce plain exactly (this fails if seeds, data order or optimiser differ)
    for seed in (0, 1):
        plain = json.loads((out / "runs" / f"plain_seed{seed}.json").read_text())
        add = json.loads((out / "runs" / f"add_seed{seed}.json").read_text())
        assert plain["train_curve"] == add["train_curve"]
        assert plain["val_curve"] == add["val_curve"]
    # different seeds give different runs
    s0 = json.loads((out / "runs" / "plain_seed0.json").read_text())
    s1 = json.loads((out / "runs" / "plain_seed1.json").read_text())
    assert s0["train_curve"] != s1["train_curve"]
    # every merge is labelled with the sub-layer feeding it: attention and MLP alternate in the GPT
    for m in ALL:
        run = json.loads((out / "runs" / f"{m}_seed0.json").read_text())
        assert run["branches"] == ["attn", "mlp"] * cfg.n_layer, (m, run["branches"])
    # the patched methods really changed the model's merges
    mgr = json.loads((out / "runs" / "mgr-competitive_seed0.json").read_text())
    assert mgr["sites"] == 2 * cfg.n_layer and mgr["train_curve"] != s0["train_curve"]


def test_tensorboard_has_losses_and_depth_scalars(pipeline):
    from tbparse import SummaryReader

    _, out, _ = pipeline
    df = SummaryReader(str(out / "tb" / "rescontroller" / "seed0")).scalars
    tags = set(df["tag"])
    assert {"train/loss", "val/loss"} <= tags
    assert any(t.startswith("resctl/stream_rms/") for t in tags), sorted(tags)[:20]
    assert np.isfinite(df["value"].to_numpy()).all()


def test_verdict_says_plainly_whether_the_difference_exceeds_the_seed_spread():
    plain = _stats([2.10, 2.12])
    assert plain["mean"] == pytest.approx(2.11) and plain["spread"] == pytest.approx(0.01)
    better = _verdict(_stats([2.00, 2.05]), plain, "validation loss")
    assert "lower than plain" in better and "beyond the seed spread" in better
    worse = _verdict(_stats([2.20, 2.30]), plain, "validation loss")
    assert "higher than plain" in worse and "beyond the seed spread" in worse
    overlap = _verdict(_stats([2.05, 2.11]), plain, "validation loss")
    assert "within the seed spread" in overlap and "no difference shown" in overlap
    single = _verdict(_stats([1.0]), _stats([2.0]), "validation loss")
    assert "no claim" in single


def test_split_by_file_is_deterministic_and_disjoint(tmp_path):
    for i in range(12):
        (tmp_path / f"f{i:02d}.py").write_text(f"# file {i}\n" + "x = 1\n" * (i + 1))
    a = stdlib_corpus(stdlib_dir=tmp_path, max_train_chars=None, max_val_chars=None, val_every=4)
    b = stdlib_corpus(stdlib_dir=tmp_path, max_train_chars=None, max_val_chars=None, val_every=4)
    assert a.val_files == ["f03.py", "f07.py", "f11.py"] and not set(a.val_files) & set(a.train_files)
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    assert "# file 3\n" in a.vocab.decode(a.val) and "# file 3\n" not in a.vocab.decode(a.train)
    capped = stdlib_corpus(stdlib_dir=tmp_path, max_train_chars=40, max_val_chars=None, val_every=4)
    assert len(capped.train) <= 40 + 2 and len(capped.train_files) >= 1


def test_default_corpus_is_the_standard_library():
    corpus = stdlib_corpus(max_train_chars=50_000, max_val_chars=10_000)
    assert corpus.train_files and corpus.val_files and not set(corpus.train_files) & set(corpus.val_files)
    assert "def " in corpus.vocab.decode(corpus.train[:20000])


def test_data_order_depends_only_on_the_seed(tmp_path):
    corpus = text_corpus(_tiny_text(tmp_path / "t.txt"))
    dm = lambda seed: CharDataModule(corpus, block_size=16, batch_size=4, train_steps=5, seed=seed)  # noqa: E731
    torch.manual_seed(123)
    first = [x for x, _ in dm(7).train_dataloader()]
    torch.manual_seed(456)  # the global RNG does not matter
    again = [x for x, _ in dm(7).train_dataloader()]
    other = [x for x, _ in dm(8).train_dataloader()]
    assert len(first) == 5 and all(torch.equal(a, b) for a, b in zip(first, again))
    assert not all(torch.equal(a, b) for a, b in zip(first, other))
    x, y = next(iter(dm(7).train_dataloader()))
    assert x.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])
    val1 = [x for x, _ in dm(7).val_dataloader()]
    val2 = [x for x, _ in dm(8).val_dataloader()]
    assert all(torch.equal(a, b) for a, b in zip(val1, val2))


def test_vocab_round_trip_and_unknown_char():
    vocab = CharVocab.from_texts("héllo\tworld\n", "ßö ")
    assert vocab.decode(vocab.encode("wörld ß")) == "wörld ß"
    with pytest.raises(ValueError, match="'z'"):
        vocab.encode("z")


def test_yaml_config_with_flags_overriding(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("depth: 3\nn-embd: 24\nn_head: 3\nsteps: 9\nmethods: [plain, mgr-competitive]\n"
                        "device: cpu\n")
    cfg = parse_config(["--config", str(cfg_file), "--steps", "11"])
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.steps) == (3, 24, 3, 11)
    assert cfg.methods == ["plain", "mgr-competitive"] and cfg.accelerator == "cpu"
    assert parse_config([]) == CompareConfig()
    bad = tmp_path / "bad.yaml"
    bad.write_text("n_layers: 3\n")
    with pytest.raises(SystemExit):
        parse_config(["--config", str(bad)])
    with pytest.raises(SystemExit):
        parse_config(["--methods", "plain,resnet"])
    with pytest.raises(SystemExit):
        parse_config(["--n-embd", "30", "--n-head", "4"])


def test_hf_dataset_without_datasets_package_says_what_to_do(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match="pip install datasets"):
        hf_corpus("some/dataset")


def test_cli_entry_point_dispatches_to_compare(monkeypatch):
    from lightning_resctl import __main__ as cli

    seen = {}
    monkeypatch.setattr(compare, "run_comparison", lambda cfg: seen.setdefault("cfg", cfg))
    assert cli.main(["compare", "--steps", "3", "--seeds", "1"]) == 0
    assert seen["cfg"].steps == 3 and seen["cfg"].seeds == 1
    assert cli.main(["bogus"]) == 2


def test_hf_dataset_loads_text_and_reports_network_errors(monkeypatch):
    import types

    rows = {"train": [{"text": f"line {i} of the training split\n"} for i in range(50)],
            "validation": [{"text": "a validation line\n"} for _ in range(5)]}

    def load_dataset(name, config=None, split="train", streaming=False):
        assert streaming and name == "me/corpus"
        if split not in rows:
            raise ValueError(f"unknown split {split}")
        return iter(rows[split])

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    corpus = hf_corpus("me/corpus", max_train_chars=400, max_val_chars=None)
    assert corpus.vocab.decode(corpus.train).startswith("line 0 of the training split")
    assert len(corpus.train) == 400 and "a validation line" in corpus.vocab.decode(corpus.val)

    def offline(*args, **kwargs):
        raise ConnectionError("no route to host")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    with pytest.raises(RuntimeError, match="could not load the Hugging Face dataset 'me/corpus'.*network"):
        hf_corpus("me/corpus")


# --- cost vs plain: interleaved steps, median of per-round ratios ----------------------------------

class _FakeModel(torch.nn.Module):
    """Records the order of training steps and advances a fake clock by its method's step time."""

    def __init__(self, log, clock):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(2))
        self.log, self.clock, self.name = log, clock, None

    def _loss(self, batch):
        self.log.append(self.name)
        self.clock["t"] += {"plain": 1.0, "slow": 2.0, "fast": 0.5}[self.name]
        return (self.w * batch[0].float().mean()).sum()

    def configure_optimizers(self):
        return {"optimizer": torch.optim.SGD(self.parameters(), lr=0.1)}


def test_cost_interleaves_methods_and_reports_median_ratio_to_plain(monkeypatch):
    from lightning_resctl.compare import cost

    log, clock = [], {"t": 0.0}
    monkeypatch.setattr(cost.time, "perf_counter", lambda: clock["t"])
    monkeypatch.setattr(cost.time, "process_time", lambda: clock["t"])

    def tag(model, name, streams=None):
        model.name = name

    monkeypatch.setattr(cost, "apply_method", tag)
    batches = [(torch.ones(2, 3),)] * 5
    res = cost.measure_cost(["slow", "fast"], lambda: _FakeModel(log, clock), batches, warmup=1)
    # plain is always measured; every round runs every method once, in a rotating order
    assert set(res["ratio"]) == {"plain", "slow", "fast"}
    rounds = [log[i:i + 3] for i in range(0, len(log), 3)]
    assert len(rounds) == 5 and all(sorted(r) == ["fast", "plain", "slow"] for r in rounds)
    assert len({tuple(r) for r in rounds}) == 3  # the order rotates
    assert res["rounds"] == 4 and all(len(v) == 4 for v in res["ratios"].values())
    assert res["ratio"] == {"plain": 1.0, "slow": 2.0, "fast": 0.5}
    assert res["step_s"]["slow"] == 2.0


# --- plots ---------------------------------------------------------------------------------------

def test_depth_plot_has_seed_band_integer_ticks_and_branch_markers():
    from matplotlib.collections import PolyCollection

    from lightning_resctl.compare.plots import SeedCurves, band_figure

    curves = {"plain": SeedCurves.from_profiles([[1, 2, 4, 8], [1, 3, 5, 9]]),
              "mgr": SeedCurves.from_profiles([[1, 1.5, 2, 2], [1, 1.4, 2.2, 2.5]])}
    assert curves["plain"].lo.tolist() == [1, 2, 4, 8] and curves["plain"].hi.tolist() == [1, 3, 5, 9]
    fig = band_figure(curves, xlabel="depth", ylabel="rms", title="t", logy=True, depth_axis=True,
                      branches=["attn", "mlp", "attn", "mlp"])
    ax = fig.axes[0]
    assert sum(isinstance(c, PolyCollection) for c in ax.collections) == 2  # one seed band per method
    ticks = [t for t in ax.get_xticks() if -0.5 <= t <= 3.5]
    assert ticks and all(float(t).is_integer() for t in ticks)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert {"attention merge", "MLP merge", "range over 2 seeds"} <= set(labels)
    markers = {line.get_marker() for line in ax.get_lines()}
    assert {"o", "s"} <= markers


def test_val_curve_band_from_per_seed_curves():
    from lightning_resctl.compare.plots import SeedCurves

    c = SeedCurves.from_curves([[(10, 3.0), (20, 2.0), (30, 1.5)], [(10, 3.2), (20, 2.2)]])
    assert c.xs.tolist() == [10, 20] and c.mean.tolist() == pytest.approx([3.1, 2.1])
    assert c.lo.tolist() == [3.0, 2.0] and c.hi.tolist() == pytest.approx([3.2, 2.2])


def test_default_validation_gives_a_curve():
    cfg = CompareConfig()
    assert cfg.steps // cfg.eval_every >= 12  # enough points to read a curve, not 8
    assert cfg.val_batches <= 3
