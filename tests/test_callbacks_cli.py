"""Both callbacks configured from a LightningCLI YAML: every merge-rule option through ``options``."""
from __future__ import annotations

import pytest
import yaml
from lightning.pytorch.cli import _JSONARGPARSE_SIGNATURES_AVAILABLE, LightningCLI  # noqa: E402

pytestmark = pytest.mark.skipif(not _JSONARGPARSE_SIGNATURES_AVAILABLE,
                                reason="LightningCLI needs jsonargparse[signatures] (the test extra)")

from lightning_resctl.callbacks import ResidualAblationCallback, ResidualControlCallback  # noqa: E402
from lightning_resctl.surgery import get_patch_report  # noqa: E402
from test_callbacks import LitGPT, _loader  # noqa: E402


class CLIModel(LitGPT):
    def __init__(self, lr: float = 0.1):
        super().__init__(lr=lr)

    def train_dataloader(self):
        return _loader()

    def val_dataloader(self):
        return _loader(n=4)


def _config(tmp_path, options, method="mgr-competitive"):
    cfg = {
        "trainer": {
            "accelerator": "cpu", "devices": 1, "max_steps": 1, "limit_val_batches": 1, "logger": False,
            "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False,
            "num_sanity_val_steps": 0, "default_root_dir": str(tmp_path),
            "callbacks": [
                {"class_path": "lightning_resctl.ResidualControlCallback",
                 "init_args": {"method": method, "options": options, "log_every_n_steps": 1,
                               "per_depth": "all", "alert_growth": 50.0}},
                {"class_path": "lightning_resctl.ResidualAblationCallback",
                 "init_args": {"max_batches": 1, "monitor": "val_loss"}},
            ],
        },
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_lightning_cli_yaml_patches_with_the_options(tmp_path):
    path = _config(tmp_path, {"streams": 3, "b_base": -2.0})
    cli = LightningCLI(CLIModel, run=False, args=["--config", str(path)], save_config_callback=None)
    (ctrl,) = [c for c in cli.trainer.callbacks if isinstance(c, ResidualControlCallback)]
    (abl,) = [c for c in cli.trainer.callbacks if isinstance(c, ResidualAblationCallback)]
    assert ctrl.patcher.method == "mgr-competitive" and ctrl.patcher.options == {"streams": 3, "b_base": -2.0}
    assert ctrl.per_depth == "all" and ctrl.alert_growth == 50.0 and abl.monitor == "val_loss"
    with pytest.warns(UserWarning, match="no logger"):
        cli.trainer.fit(cli.model)
    report = get_patch_report(cli.model)
    assert report is not None and report.method == "mgr-competitive"
    assert report.options["streams"] == 3 and report.options["b_base"] == -2.0 and len(report.sites) == 4


def test_lightning_cli_yaml_typo_fails_before_fit(tmp_path):
    path = _config(tmp_path, {"stream": 3})
    with pytest.raises(ValueError, match=r"unknown option\(s\) for method='mgr-competitive': \['stream'\]"):
        LightningCLI(CLIModel, run=False, args=["--config", str(path)], save_config_callback=None)
    path = _config(tmp_path, {"streams": 1})
    with pytest.raises(ValueError, match="streams must be an int >= 2"):
        LightningCLI(CLIModel, run=False, args=["--config", str(path)], save_config_callback=None)
