"""patch_residuals under Lightning: from a Callback's setup, and in a 2-process CPU DDP run."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from ddp_surgery_script import LitGPT, PatchInSetup

SCRIPT = Path(__file__).resolve().parent / "ddp_surgery_script.py"


def test_patch_in_callback_setup_puts_mgr_parameters_in_the_optimizer():
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randint(0, 32, (8, 8)))
    model = LitGPT()
    cb = PatchInSetup()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[cb])
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=4))
    mgr = {n: p for n, p in model.named_parameters() if "_resctl_mgr" in n}
    assert len(mgr) > 0 and set(mgr) == set(cb.init)
    in_opt = {id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]}
    assert all(id(p) in in_opt for p in mgr.values())
    changed = [n for n, p in mgr.items() if not torch.equal(p.detach(), cb.init[n])]
    assert any("gate_bias" in n for n in changed) and any("pool_query" in n for n in changed)


DDP_METHODS = ("mgr", "attnres-block", "hc", "mhc-lite", "dwa", "ddl")


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    """One launch of the two DDP processes, training each of ``DDP_METHODS`` in turn."""
    out = tmp_path_factory.mktemp("ddp")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE"))}
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out), ",".join(DDP_METHODS)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@pytest.mark.parametrize("method", DDP_METHODS)
def test_ddp_two_processes(ddp_runs, method):
    r0 = torch.load(ddp_runs / f"{method}_rank0.pt", weights_only=False)
    r1 = torch.load(ddp_runs / f"{method}_rank1.pt", weights_only=False)
    for r in (r0, r1):
        assert r["world_size"] == 2 and r["sites"] == 4 and r["merge_sites"] == 4
        assert r["wrapped_is_patched_model"]
        assert set(r["final"]) <= set(r["optimizer_params"])
    assert (r0["rank"], r1["rank"]) == (0, 1)
    # the rule's parameters were trained, and DDP kept the ranks in sync (they saw different batches)
    assert r0["final"] and set(r0["final"]) == set(r0["init"])
    changed = [n for n in r0["final"] if not torch.equal(r0["final"][n], r0["init"][n])]
    if method == "mgr":
        assert any("gate_bias" in n for n in changed)
    assert changed
    for name, value in r0["all_final"].items():
        torch.testing.assert_close(r1["all_final"][name], value, rtol=0, atol=1e-6)
