"""Coverage sweep of ``patch_residuals`` over timm: one model per architecture module (``timm.list_modules()``).

Each module's model with the fewest parameters (:data:`MODELS`, counted on the meta device for timm 1.0.31;
:func:`smallest_models` recounts for another version) is built with ``pretrained=False`` (random init, nothing
downloaded) — with ``depth=2`` where its constructor takes a ``depth`` — and run on 2 random images of the
smallest size it accepts among :data:`SIZES` (passed as ``img_size`` where the model takes it), else its
default input size, through the checks of :func:`lightning_resctl.surgery.coverage.run_checks`. timm is
imported with :func:`lightning_resctl.testing.timm_import.import_timm` (no torchvision needed).

The structural expectation (:func:`expected_merges`) is read from the model's modules: see its docstring.

``benchmarks/coverage.py --library timm`` is the command line; the test suite runs a fixed sample.
"""
from __future__ import annotations

import re
from typing import Optional

import torch
from torch import nn

from .coverage import FamilyResult, run_checks

__all__ = ["MODELS", "SIZES", "architectures", "smallest_models", "build", "expected_merges", "run_architecture",
           "NOTES"]

#: image sizes tried, smallest first (then the model's default input size)
SIZES = (32, 64, 96, 128)

#: timm 1.0.31: per architecture module, its model with the fewest parameters (:func:`smallest_models`)
MODELS = {
    "beit": "beit_base_patch16_224",
    "byoanet": "halonet_h1",
    "byobnet": "test_byobnet",
    "cait": "cait_xxs24_224",
    "coat": "coat_tiny",
    "convit": "convit_tiny",
    "convmixer": "convmixer_768_32",
    "convnext": "test_convnext",
    "cpubone": "cpubone_nano",
    "crossvit": "crossvit_tiny_240",
    "csatv2": "csatv2",
    "cspnet": "cs3darknet_focus_s",
    "cspnext": "cspnext_tiny",
    "davit": "davit_tiny",
    "deepseek_vit": "deepseek_vit_412m",
    "deit": "deit_tiny_patch16_224",
    "densenet": "densenet121",
    "dla": "dla46x_c",
    "dpn": "dpn48b",
    "edgenext": "edgenext_xx_small",
    "efficientformer": "efficientformer_l1",
    "efficientformer_v2": "efficientformerv2_s0",
    "efficientnet": "test_efficientnet",
    "efficientvim": "efficientvim_m1",
    "efficientvit_mit": "efficientvit_b0",
    "efficientvit_msra": "efficientvit_m0",
    "eva": "vit_tiny_patch16_dinov3_qkvb",
    "fasternet": "fasternet_t0",
    "fastvit": "fastvit_t8",
    "focalnet": "focalnet_tiny_srf",
    "gcvit": "gcvit_xxtiny",
    "gemma4_vit": "gemma4_vit_167m",
    "ghostnet": "ghostnet_050",
    "hardcorenas": "hardcorenas_b",
    "hgnet": "hgnetv2_b0",
    "hiera": "hiera_tiny_224",
    "hieradet_sam2": "sam2_hiera_tiny",
    "hrnet": "hrnet_w18_small",
    "iformer": "iformer_t",
    "inception_next": "inception_next_atto",
    "inception_resnet_v2": "inception_resnet_v2",
    "inception_v3": "inception_v3",
    "inception_v4": "inception_v4",
    "lcnetv2": "lcnetv2_small",
    "levit": "levit_128s",
    "lowformer": "lowformer_b0",
    "mambaout": "test_mambaout",
    "maxxvit": "test_coatnet",
    "metaformer": "poolformerv2_s12",
    "mlp_mixer": "gmlp_ti16_224",
    "mobilenetv3": "mobilenetv3_small_050",
    "mobilenetv5": "mobilenetv5_base",
    "mobilevit": "mobilevit_xxs",
    "mvitv2": "mvitv2_tiny",
    "naflexvit": "naflexvit_base_patch16_parfac_gap",
    "nasnet": "nasnetalarge",
    "nest": "nest_tiny",
    "nextvit": "nextvit_small",
    "nfnet": "test_nfnet",
    "pit": "pit_ti_224",
    "pnasnet": "pnasnet5large",
    "pvt_v2": "pvt_v2_b0",
    "qwen3_vit": "qwen3_vit_88m",
    "rdnet": "rdnet_tiny",
    "regnet": "regnetx_002",
    "repghost": "repghostnet_050",
    "repvit": "repvit_m1",
    "res2net": "res2next50",
    "resnest": "resnest14d",
    "resnet": "test_resnet",
    "resnetv2": "resnetv2_18",
    "rexnet": "rexnet_100",
    "selecsls": "selecsls42",
    "senet": "legacy_seresnet18",
    "sequencer": "sequencer2d_s",
    "shvit": "shvit_s1",
    "sknet": "skresnet18",
    "starnet": "starnet_s050",
    "swiftformer": "swiftformer_xs",
    "swin_transformer": "swin_tiny_patch4_window7_224",
    "swin_transformer_v2": "swinv2_tiny_window8_256",
    "swin_transformer_v2_cr": "swinv2_cr_tiny_224",
    "tiny_vit": "tiny_vit_5m_224",
    "tnt": "tnt_s_legacy_patch16_224",
    "tresnet": "tresnet_m",
    "twins": "twins_svt_small",
    "vgg": "vgg11",
    "visformer": "visformer_tiny",
    "vision_transformer": "test_vit",
    "vision_transformer_hybrid": "vit_tiny_r_s16_p8_224",
    "vision_transformer_relpos": "test_vit_relpos",
    "vision_transformer_sam": "samvit_base_patch16_224",
    "vitamin": "vitamin_small_224",
    "volo": "volo_d1_224",
    "vovnet": "ese_vovnet19b_slim_dw",
    "xception": "legacy_xception",
    "xception_aligned": "xception41p",
    "xcit": "xcit_nano_12_p8_224",
}

#: what a look at the modules that do not match showed (printed with their row in docs/coverage.md)
NOTES: dict = {}


def _timm():
    from ..testing.timm_import import import_timm

    return import_timm()


def smallest_models() -> dict:
    """Per architecture module of the installed timm, its model with the fewest parameters (each model built
    on the meta device: no memory, no init; slow — minutes — because it builds every registered model)."""
    timm = _timm()
    best: dict = {}
    for module in timm.list_modules():
        for name in timm.list_models(module=module):
            try:
                with torch.device("meta"):
                    model = timm.create_model(name, pretrained=False)
            except Exception:  # noqa: BLE001 - a model that cannot be built on meta is not ranked
                continue
            count = sum(p.numel() for p in model.parameters())
            if module not in best or count < best[module][1]:
                best[module] = (name, count)
    return {module: name for module, (name, _) in best.items()}


def architectures() -> dict:
    """module -> model name: :data:`MODELS` for the modules it lists, the first model of the others (a module
    added by another timm version: run ``smallest_models()`` and update :data:`MODELS`)."""
    timm = _timm()
    out = {}
    for module in timm.list_modules():
        names = timm.list_models(module=module)
        if names:
            out[module] = MODELS.get(module) if MODELS.get(module) in names else names[0]
    return out


def build(name: str) -> tuple:
    """(model, images): ``name`` built small (``depth=2`` where taken) on the smallest input it runs on."""
    timm = _timm()
    errors = []
    for extra in ({"depth": 2}, {}):
        for size in SIZES:
            for kwargs in ({**extra, "img_size": size}, extra):
                try:
                    torch.manual_seed(0)
                    model = timm.create_model(name, pretrained=False, **kwargs)
                    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))
                    model.train()
                    with torch.no_grad():
                        model(x)
                    return model, x
                except Exception as err:  # noqa: BLE001 - try the next size
                    errors.append(f"{kwargs}: {type(err).__name__}: {str(err)[:80]}")
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False)
    size = model.pretrained_cfg.get("input_size", (3, 224, 224))
    x = torch.randn(2, *size, generator=torch.Generator().manual_seed(1))
    return model, x
