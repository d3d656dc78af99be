"""A rule's config dataclass passed to patch_residuals (``patch_residuals(model, MGRConfig(streams=8))``) patches
exactly as its name and keyword options do: same report, same state_dict keys, same site records."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from lightning_resctl import merge_rules, patch_residuals
from lightning_resctl.rules import get_merge_rule
from lightning_resctl.rules.mgr import MGRConfig
from lightning_resctl.rules.rescontroller import ResControllerConfig
from lightning_resctl.surgery.record import decode_record, is_site_record_key

C = 8


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.f = nn.ModuleList(nn.Sequential(nn.LayerNorm(C), nn.Linear(C, C)) for _ in range(2))

    def forward(self, x):
        for f in self.f:
            x = x + f(x)
        return x


def _patched(method, **options):
    torch.manual_seed(0)
    model = Net()
    report = patch_residuals(model, method, example_input=(torch.randn(2, 3, C),), **options)
    return model, report


def _records(model) -> dict:
    return {k: decode_record(v) for k, v in model.state_dict().items() if is_site_record_key(k)}


#: every rule with options registered under a name that presets none (the name its config stands for)
NAMED = [m for m in merge_rules()
         if not get_merge_rule(m).preset and dataclasses.fields(get_merge_rule(m).rule_class.Config)]


@pytest.mark.parametrize("method, options", [("mgr", {"streams": 8}), ("rescontroller", {"update_ratio": 0.3}),
                                             *[(m, {}) for m in NAMED if m not in ("mgr", "rescontroller")]])
def test_a_config_patches_as_the_name_and_options_do(method, options):
    config = get_merge_rule(method).rule_class.Config(**options)
    by_name, named = _patched(method, **options)
    by_config, typed = _patched(config)
    assert typed.method == named.method == method
    assert typed.options == named.options
    assert [s.location for s in typed.sites] == [s.location for s in named.sites]
    assert list(by_config.state_dict()) == list(by_name.state_dict())
    assert _records(by_config) == _records(by_name) and _records(by_name)
    torch.testing.assert_close(by_config(torch.ones(1, 2, C)), by_name(torch.ones(1, 2, C)))


def test_the_config_classes_the_brief_names():
    model, report = _patched(MGRConfig(streams=8))
    assert (report.method, report.options["streams"]) == ("mgr", 8)
    model, report = _patched(ResControllerConfig())
    assert report.method == "rescontroller"


def test_a_config_with_keyword_options_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"MGRConfig.*streams=4"):
        _patched(MGRConfig(streams=8), streams=4)


def test_a_config_no_rule_has_is_refused():
    @dataclasses.dataclass
    class Other:
        streams: int = 4

    with pytest.raises(TypeError, match="Other is not the config of any registered merge rule"):
        _patched(Other())
