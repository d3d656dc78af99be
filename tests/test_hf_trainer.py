"""ResidualTrainerCallback: Hugging Face's Trainer with the patch and the diagnostics (tiny random-init GPT-2 on
CPU, TensorBoard event files read back with tbparse, nothing downloaded)."""
from __future__ import annotations

import ast
import copy
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from tbparse import SummaryReader  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

import lightning_resctl  # noqa: E402
from lightning_resctl import ResidualMonitor, ResidualTrainerCallback, get_patch_report, merge_sites  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _gpt2():
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0,
                     eos_token_id=0, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def _data(n=16, T=8, seed=0):
    ids = torch.randint(0, 64, (n, T), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": r, "labels": r} for r in ids]


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), logging_dir=None, max_steps=4, per_device_train_batch_size=4,
                logging_steps=2, report_to=["tensorboard"], use_cpu=True, save_strategy="no", learning_rate=1e-2,
                seed=0, disable_tqdm=True, dataloader_num_workers=0)
    base.update(kw)
    base.pop("logging_dir")
    return TrainingArguments(**base)


def _scalars(tmp_path):
    return SummaryReader(str(tmp_path / "out" / "runs")).scalars


def _accumulator(tmp_path):
    """The Trainer's TensorBoard run (``output_dir/runs/<date>_<host>``): images, histograms, text."""
    (run,) = (tmp_path / "out" / "runs").iterdir()
    acc = EventAccumulator(str(run), size_guidance={"images": 0, "histograms": 0, "tensors": 0, "scalars": 0})
    acc.Reload()
    return acc


def test_trainer_patches_trains_logs_and_the_saved_folder_reloads_bitwise(tmp_path):
    model = _gpt2()
    cb = ResidualTrainerCallback(method="mgr-competitive", options={"streams": 2})
    trainer = Trainer(model=model, args=_args(tmp_path), train_dataset=_data(), callbacks=[cb])
    # patched by Trainer(...), before train() builds the optimizer
    report = get_patch_report(model)
    assert report is not None and report.method == "mgr-competitive" and report.new_parameters
    params = dict(model.named_parameters())
    at_patch = {n: params[n].detach().clone() for n in report.new_parameters}
    trainer.train()
    held = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert all(id(params[n]) in held for n in report.new_parameters)  # the optimizer holds the rule's parameters
    trained = [n for n, v in at_patch.items() if not torch.equal(params[n], v)]
    assert len(trained) >= len(at_patch) - 1  # (the first merge's pool query gets no gradient: equal streams)

    # TensorBoard: the Trainer's own scalars and the diagnostics in the same run, at the same steps
    df = _scalars(tmp_path)
    tags = set(df.tag)
    assert {"train/loss", "resctl/summary/growth_last", "resctl/summary/gate_saturation",
            "resctl/stream_rms/00", "resctl/stream_grad_rms/03", "resctl/param_grad_rms/00"} <= tags
    assert sorted(df[df.tag == "train/loss"].step) == [2, 4]
    assert sorted(df[df.tag == "resctl/summary/growth_last"].step) == [2, 4]
    acc = _accumulator(tmp_path)
    assert {"resctl/depth_profile/rms", "resctl/depth_heatmap/stream_rms"} <= set(acc.Tags()["images"])
    assert "resctl/mgr_gate_hist_s0/01" in acc.Tags()["histograms"]
    assert "resctl/about/text_summary" in acc.Tags()["tensors"]

    # save_pretrained, reload with the loader: the same network, bitwise
    model.eval()
    trainer.save_model(str(tmp_path / "saved"))
    loaded = lightning_resctl.from_pretrained(AutoModelForCausalLM, tmp_path / "saved")
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(loaded.generate(ids, **kw), model.generate(ids, **kw))


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "activation_checkpointing"])
def test_logged_values_are_the_monitors_on_the_same_batch(tmp_path, checkpointing):
    """The callback logs what ResidualMonitor records when driven by hand on the same model and batch (one step,
    no gradient clipping); with activation checkpointing (a per-merge rule runs inside it) the values are the same."""
    data = _data(n=4)
    model = _gpt2()
    cb = ResidualTrainerCallback(method="rescontroller", log_every_n_steps=1, per_depth="all", depth_images=False)
    trainer = Trainer(model=model, args=_args(tmp_path, max_steps=1, max_grad_norm=0.0,
                                              gradient_checkpointing=checkpointing),
                      train_dataset=data, callbacks=[cb])
    reference = copy.deepcopy(model)
    reference.activation_checkpointing_disable()
    trainer.train()
    if checkpointing:
        assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())

    monitor = ResidualMonitor(reference, log_every_n_steps=1, per_depth="all")
    batch = torch.stack([d["input_ids"] for d in data])
    reference.train()
    with monitor.step(0):  # the Trainer's loss: summed, over its count of label tokens (before the shift)
        reference(input_ids=batch, labels=batch, num_items_in_batch=torch.tensor(batch.numel())).loss.backward()
    expected = monitor.metrics()
    df = _scalars(tmp_path)
    logged = {r.tag: r.value for r in df.itertuples() if r.tag.startswith("resctl/")}
    assert set(df[df.tag.str.startswith("resctl/")].step) == {1}
    assert set(logged) == set(expected) and len(expected) > 20
    for tag, value in expected.items():
        assert logged[tag] == pytest.approx(value, rel=1e-4, abs=1e-7), tag


@pytest.mark.parametrize("method", ["mgr-competitive", "attnres-block", "mhc-lite"])
def test_a_stream_carrying_rule_trains_the_same_with_gradient_checkpointing(tmp_path, method):
    """``gradient_checkpointing=True`` (HF's non-reentrant default): the same weights after the steps as without,
    for the rules that carry streams beside the model (MGR without its inversion, which rounds differently)."""
    # MGR: the eager torch path in both runs (a background compile landing between them would round differently)
    options = {"invert": False, "backend": "torch-eager"} if method.startswith("mgr") else {}
    weights = {}
    for ckpt in (False, True):
        torch.manual_seed(0)
        model = _gpt2()
        cb = ResidualTrainerCallback(method=method, options=options)
        Trainer(model=model, args=_args(tmp_path / str(ckpt), gradient_checkpointing=ckpt, max_steps=3),
                train_dataset=_data(), callbacks=[cb]).train()
        assert merge_sites(model) and model.is_gradient_checkpointing == ckpt
        weights[ckpt] = {k: v.detach().clone() for k, v in model.named_parameters()}
    assert set(weights[True]) == set(weights[False]) and any("_resctl" in k for k in weights[True])
    for k, v in weights[False].items():
        torch.testing.assert_close(weights[True][k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_reentrant_gradient_checkpointing_is_refused_before_backward(tmp_path):
    cb = ResidualTrainerCallback(method="mgr", options={"streams": 2})
    trainer = Trainer(model=_gpt2(), args=_args(tmp_path, gradient_checkpointing=True,
                                                gradient_checkpointing_kwargs={"use_reentrant": True}),
                      train_dataset=_data(), callbacks=[cb])
    with pytest.raises(RuntimeError, match="use_reentrant"):
        trainer.train()


def test_an_optimizer_built_before_the_patch_is_refused(tmp_path):
    model = _gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cb = ResidualTrainerCallback(method="mgr", options={"streams": 2})
    with pytest.raises(ValueError, match="optimizers="):
        Trainer(model=model, args=_args(tmp_path), train_dataset=_data(), optimizers=(opt, None), callbacks=[cb])


def test_observing_removes_its_add_patch_and_logs_the_same_tags(tmp_path):
    model = _gpt2()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cb = ResidualTrainerCallback(depth_images=False)  # method=None: observe
    trainer = Trainer(model=model, args=_args(tmp_path, max_steps=2), train_dataset=_data(), callbacks=[cb])
    assert not merge_sites(model)  # nothing is patched before training: no parameter is added
    trainer.train()
    assert not merge_sites(model) and get_patch_report(model) is None
    assert set(model.state_dict()) == set(before)
    assert "resctl/summary/growth_last" in set(_scalars(tmp_path).tag)


def test_without_a_reporting_integration_it_warns_and_runs_no_probe(tmp_path):
    cb = ResidualTrainerCallback(method="rescontroller")
    trainer = Trainer(model=_gpt2(), args=_args(tmp_path, max_steps=2, report_to=[]), train_dataset=_data(),
                      callbacks=[cb])
    with pytest.warns(UserWarning, match="nowhere to write"):
        trainer.train()
    assert cb.depth_profile == {} and merge_sites(trainer.model)


def test_mlflow_gets_the_scalars(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the local file store behind this switch
    cb = ResidualTrainerCallback(method="rescontroller", depth_images=False, histograms=False)
    trainer = Trainer(model=_gpt2(), args=_args(tmp_path, report_to=["mlflow"]), train_dataset=_data(),
                      callbacks=[cb])
    trainer.train()
    import mlflow

    run = mlflow.search_runs(search_all_experiments=True, output_format="list")[0]
    history = mlflow.MlflowClient().get_metric_history(run.info.run_id, "resctl/summary/growth_last")
    assert sorted(m.step for m in history) == [2, 4]
    assert sorted(m.step for m in mlflow.MlflowClient().get_metric_history(run.info.run_id, "loss")) == [2, 4]


def test_transformers_stays_optional():
    """transformers is imported lazily: no module of the package imports it (or the Trainer adapter) when the
    package or any other module is imported; only the adapter module itself does."""
    offenders = []
    for path in sorted((ROOT / "lightning_resctl").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.parse(path.read_text(encoding="utf-8")).body:  # module level only, not inside functions
            for stmt in ast.walk(node) if isinstance(node, (ast.Try, ast.If)) else [node]:
                names = ([a.name for a in stmt.names] if isinstance(stmt, ast.Import)
                         else [stmt.module or ""] if isinstance(stmt, ast.ImportFrom) else [])
                if any(n == "transformers" or n.startswith("transformers.") or n.endswith("hf_trainer")
                       for n in names) and rel != "lightning_resctl/callbacks/hf_trainer.py":
                    offenders.append(f"{rel}:{stmt.lineno}")
    assert not offenders


def test_a_model_rebuilt_by_model_init_is_refused_not_trained_unpatched(tmp_path):
    cb = ResidualTrainerCallback(method="rescontroller")
    trainer = Trainer(model_init=_gpt2, args=_args(tmp_path, max_steps=1), train_dataset=_data(), callbacks=[cb])
    with pytest.raises(RuntimeError, match="model_init"):
        trainer.train()


def test_wandb_offline_run_gets_the_scalars_and_figures(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from test_callbacks_loggers import _wandb_history

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    cb = ResidualTrainerCallback(method="rescontroller", histograms=False)
    trainer = Trainer(model=_gpt2(), args=_args(tmp_path, report_to=["wandb"]), train_dataset=_data(),
                      callbacks=[cb])
    trainer.train()
    import wandb

    run_dir = Path(wandb.run.dir).parent
    wandb.finish()
    wandb.teardown()  # waits until the run file is written
    (run_file,) = run_dir.glob("run-*.wandb")
    rows = _wandb_history(run_file)
    ours = [r for r in rows if "resctl/summary/growth_last" in r]
    assert [r["train/global_step"] for r in ours] == [2, 4]  # the Trainer's step axis, beside its own train/loss
    assert [r["train/global_step"] for r in rows if "train/loss" in r] == [2, 4]
    assert ours[-1]["resctl/stream_rms/03"] == pytest.approx(cb.depth_profile["stream_rms"][3], rel=1e-6)
    assert any(k.startswith("resctl/depth_profile/") and k.endswith("/_type") for r in rows for k in r)


def test_bad_arguments_raise_on_construction():
    with pytest.raises(ValueError, match="streamz"):
        ResidualTrainerCallback(method="mgr", options={"streamz": 2})
    with pytest.raises(ValueError, match="no-such-rule"):
        ResidualTrainerCallback(method="no-such-rule")
    with pytest.raises(ValueError, match="log_every_n_steps"):
        ResidualTrainerCallback(log_every_n_steps=0)
