"""Coverage sweep of ``patch_residuals`` over timm: one model per architecture module (``timm.list_modules()``).

Each module's model with the fewest parameters (:data:`MODELS`, counted on the meta device for timm 1.0.31;
:func:`smallest_models` recounts for another version) is built with ``pretrained=False`` (random init, nothing
downloaded) — with ``depth=2`` where its constructor takes a ``depth`` — and run on 2 random images of the
smallest size it accepts among :data:`SIZES` (passed as ``img_size`` where the model takes it), else its
default input size, through the checks of :func:`benchmarks.coverage_hf.run_checks`. timm is
imported with :func:`benchmarks.timm_import.import_timm` (no torchvision needed).

The structural expectation (:func:`expected_merges`) is read from the model's modules: see its docstring.

``benchmarks/coverage.py --library timm`` is the command line; the test suite runs a fixed sample.
"""
from __future__ import annotations

import re
from typing import Optional

import torch
from torch import nn

from benchmarks.coverage_hf import FamilyResult, run_checks

__all__ = ["MODELS", "SIZES", "BLOCKS", "NO_RESIDUAL", "architectures", "smallest_models", "build", "expected_merges",
           "run_architecture", "NOTES"]

#: image sizes tried, smallest first (then the model's default input size)
SIZES = (32, 56, 64, 96, 112, 128)

#: timm 1.0.31: per architecture module, its model with the fewest parameters (:func:`smallest_models`), or,
#: where every block of that one projects its shortcut (one block per stage), the smallest whose blocks include
#: an identity residual
MODELS = {
    "beit": "beit_base_patch16_224",
    "byoanet": "halonet_h1",
    "byobnet": "gernet_s",  # smallest: test_byobnet, every block projects
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
    "efficientnet": "mobilenetv2_050",  # smallest: test_efficientnet, every block projects
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
    "nfnet": "nf_regnet_b0",  # smallest: test_nfnet, every block projects
    "pit": "pit_ti_224",
    "pnasnet": "pnasnet5large",
    "pvt_v2": "pvt_v2_b0",
    "qwen3_vit": "qwen3_vit_88m",
    "rdnet": "rdnet_tiny",
    "regnet": "regnetx_002",
    "repghost": "repghostnet_050",
    "repvit": "repvit_m1",
    "res2net": "res2next50",
    "resnest": "resnest26d",  # smallest: resnest14d, every block projects
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
    "vovnet": "ese_vovnet39b",  # smallest: ese_vovnet19b_slim_dw, every block projects
    "xception": "legacy_xception",
    "xception_aligned": "xception41p",
    "xcit": "xcit_nano_12_p8_224",
}

#: what a look at the modules that do not match showed (printed with their row in docs/coverage.md)
NOTES: dict = {}


def _timm():
    from benchmarks.timm_import import import_timm

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


# ---------------------------------------------------------------------------------------------- expectation
_SLOT = re.compile(r"(^|_)drop_path\d*$")
# a block attribute holding a shortcut: a module other than an identity there is a projection
_SHORTCUTS = ("downsample", "shortcut", "skip", "shortcut_proj_attn", "shortcut_proj_mlp")
# block attributes saying the block adds no shortcut (value False), or (``no_skip``) value True
_FLAGS = ("has_skip", "residual", "use_residual", "use_res_connect", "has_residual", "use_shortcut")


def _same_shape(m, x, out) -> int:
    return int(tuple(x.shape) == tuple(out.shape))


#: residual modules whose merges the drop_path convention does not give, read from their ``forward``:
#: (timm module — "layers" for timm.layers —, class) -> merges per call, an int or ``f(module, input, output)``
BLOCKS = {
    ("layers", "GlobalResponseNorm"): 1,          # x + addcmul(bias, weight, x * Nx): GRN's residual (ConvNeXt-V2)
    ("convmixer", "Residual"): 1,                 # return self.fn(x) + x
    ("coat", "ConvPosEnc"): 1,                    # x = self.proj(feat) + feat
    ("davit", "ConvPosEnc"): 1,                   # x = x + self.act(feat)
    ("csatv2", "PosConv"): 1,                     # x = self.proj(cnn_feat) + cnn_feat
    ("csatv2", "SpatialTransformerBlock"): 2,     # x = shortcut + x_t, twice
    ("twins", "PosConv"): lambda m, x, out: int(m.stride == 1),   # if self.stride == 1: x += cnn_feat_token
    ("efficientvim", "PatchMerging"): lambda m, x, out: 0 if m.fused else 2,   # x + self.dwconv1(x), dwconv2
    ("efficientvit_mit", "ResidualBlock"): lambda m, x, out: int(m.shortcut is not None and m.main is not None),
    ("cpubone", "ResidualBlock"): lambda m, x, out: int(m.shortcut is not None and m.main is not None),
    ("lowformer", "ResidualBlock"): lambda m, x, out: int(m.shortcut is not None and m.main is not None),
    ("efficientvit_msra", "ResidualDrop"): 1,     # return x + self.m(x)
    ("shvit", "Residual"): 1,                     # return x + self.m(x)
    ("fastvit", "RepMixer"): 1,                   # x = x + self.layer_scale(self.mixer(x) - self.norm(x))
    ("gcvit", "MbConvBlock"): 1,                  # x = x + shortcut
    ("dla", "DlaBasic"): _same_shape,             # out += shortcut (a projected shortcut changes the shape)
    ("dla", "DlaBottleneck"): _same_shape,
    ("dla", "DlaBottle2neck"): _same_shape,
    ("dpn", "DualPathBlock"): lambda m, x, out: int(not m.has_proj),   # x_s1 + out1 on the residual channels
    ("inception_resnet_v2", "Block35"): 1,        # out = out * self.scale + x
    ("inception_resnet_v2", "Block17"): 1,
    ("inception_resnet_v2", "Block8"): 1,
    ("lcnetv2", "RepDepthwiseSeparable"): lambda m, x, out: int(m.use_shortcut),   # x = x + shortcut
    ("repvit", "RepVggDw"): 1,                    # self.conv(x) + self.conv1(x) + x
    ("repvit", "RepViTBlock"): 1,                 # return identity + x
    ("repvit", "RepVitDownsample"): 1,            # return x + identity
    ("senet", "SEResNetBlock"): _same_shape,      # out = self.se_module(out) + shortcut
    ("senet", "SEResNetBottleneck"): _same_shape,
    ("senet", "SEResNeXtBottleneck"): _same_shape,
    ("senet", "SEBottleneck"): _same_shape,
    ("swiftformer", "EfficientAdditiveAttention"): 1,   # out = self.proj(attn * key) + query
    ("xception", "Block"): _same_shape,           # x += skip
    ("ghostnet", "GhostBottleneck"): _same_shape,  # x += self.shortcut(shortcut): an empty Sequential if identity
    ("ghostnet", "GhostBottleneckV3"): _same_shape,
    ("repghost", "RepGhostBottleneck"): _same_shape,
    ("rdnet", "DenseBlock"): 0,                   # a dense block: its branch is concatenated, not added
    ("nasnet", "NormalCell"): 1,                  # x_comb_iter_4 = comb_iter_4_left(x_right) + x_right
    ("nasnet", "FirstCell"): 1,
    # the token mixer's merge exists only where there is a token mixer (drop_path1 is None otherwise)
    ("efficientformer_v2", "EfficientFormerV2Block"): lambda m, x, out: 1 + (m.token_mixer is not None),
    # the stream scaled by a learned Scale (res_scale) is no identity stream
    ("metaformer", "MetaFormerBlock"): lambda m, x, out: sum(isinstance(r, nn.Identity)
                                                          for r in (m.res_scale1, m.res_scale2)),
    # a stage's first block projects the stream (self.proj) for its attention merge; the MLP merge follows
    ("hiera", "HieraBlock"): lambda m, x, out: 2 - (m.proj is not None),
    ("hieradet_sam2", "MultiScaleBlock"): lambda m, x, out: 2 - (not isinstance(m.proj, nn.Identity)),
}

#: architecture modules without a residual connection (plain, inception, dense or NAS cells with no identity)
NO_RESIDUAL = ("densenet", "vgg", "inception_v3", "inception_v4", "selecsls", "pnasnet")


def _slots(module: nn.Module) -> list:
    """The ``drop_path*`` slots of ``module``: child modules (a DropPath or its Identity placeholder) and
    attributes left ``None``."""
    names = [n for n in module._modules if _SLOT.search(n)]
    names += [n for n, v in vars(module).items() if v is None and _SLOT.search(n) and n not in names]
    return names


def _no_skip(module: nn.Module) -> Optional[str]:
    """Why block ``module`` adds no shortcut at all (a flag), or None."""
    flags = vars(module)
    for flag in _FLAGS:
        if flags.get(flag) is False:
            return f"{flag}=False"
    if flags.get("no_skip") is True:
        return "no_skip=True"
    for attr in ("shortcut", "skip"):
        if attr in module._modules and module._modules[attr] is None or flags.get(attr, 0) is None:
            return f"{attr}=None"
    return None


def _projection(module: nn.Module) -> Optional[str]:
    """The projection shortcut of block ``module`` (a shortcut module that is not an identity), or None."""
    for attr in _SHORTCUTS:
        sub = module._modules.get(attr)
        if isinstance(sub, nn.Module) and not isinstance(sub, nn.Identity) \
                and not (isinstance(sub, nn.Sequential) and len(sub) == 0):
            return f"{attr} is a {type(sub).__name__}"
    return None


def _key(module: nn.Module) -> tuple:
    path = type(module).__module__
    short = "layers" if path.startswith("timm.layers") else path.rsplit(".", 1)[-1]
    return short, type(module).__name__


def expected_merges(model: nn.Module, x: torch.Tensor, architecture: str = "") -> tuple:
    """(expected merge count or None, how it was derived), read from the model's blocks during one forward.

    * timm puts a stochastic-depth slot on each residual branch (``drop_path``, ``drop_path1``,
      ``attn_drop_path``...: a ``DropPath``, or an ``nn.Identity`` or ``None`` at rate 0): each call of a slot
      is one merge of its block (a ``None`` slot: one per call of the block);
    * a block whose shortcut is a projection (a ``downsample``/``shortcut``/``skip`` module that is not an
      identity) has one merge fewer per call — the projected one; a block that adds no shortcut
      (``has_skip=False``, ``use_shortcut=False``, ``no_skip=True``, ``shortcut=None``...) has none;
    * the residual modules of :data:`BLOCKS` (no slot, or a rule of their own: a learned scale on the stream,
      a stage's projecting block) count what their entry says; a layer-scale product is part of its branch;
    * an architecture of :data:`NO_RESIDUAL` has 0.
    None when the model has neither slots nor a :data:`BLOCKS` entry."""
    if architecture in NO_RESIDUAL:
        return 0, "no residual connection in the architecture"
    owner_of = {}
    for module in model.modules():
        if _key(module) in BLOCKS:
            continue
        for name in _slots(module):
            sub = module._modules.get(name)
            if sub is not None:
                owner_of[id(sub)] = module
    counts: dict = {}
    described: dict = {}

    def hook(module, args, out):
        key = _key(module)
        x_in = next((a for a in args if isinstance(a, torch.Tensor)), None)
        y = out if isinstance(out, torch.Tensor) else None
        if key in BLOCKS or _slots(module):
            counts.setdefault(id(module), 0)
        if key in BLOCKS:
            rule = BLOCKS[key]
            n = rule if isinstance(rule, int) else rule(module, x_in, y)
            counts[id(module)] = counts.get(id(module), 0) + n
            described[key[1]] = described.get(key[1], 0) + n
            return
        owner = owner_of.get(id(module))
        if owner is not None and not _no_skip(owner):
            counts[id(owner)] = counts.get(id(owner), 0) + 1
        if _slots(module) and not _no_skip(module):
            nones = sum(1 for n in _slots(module) if module._modules.get(n) is None)
            counts[id(module)] = counts.get(id(module), 0) + nones - (1 if _projection(module) else 0)

    from torch.nn.modules.module import register_module_forward_hook

    handle = register_module_forward_hook(hook)
    try:
        with torch.no_grad(), torch.random.fork_rng():
            model(x)
    finally:
        handle.remove()
    if not counts:
        return None, "no drop_path slot and no known residual block: no structural count"
    total = sum(max(0, c) for c in counts.values())
    how = "drop_path slot calls, less projections and no-skip blocks"
    if described:
        how += " + " + ", ".join(f"{k} {v}" for k, v in sorted(described.items()))
    return total, how


def _call(model, x):
    out = model(x)
    return out if isinstance(out, torch.Tensor) else out[0]


def run_architecture(module: str, name: Optional[str] = None, timeout: Optional[float] = 120.0) -> FamilyResult:
    """Build and check the model ``name`` (default: :func:`architectures`' choice) of timm's architecture
    ``module`` (:func:`~benchmarks.coverage_hf.run_checks`); never raises."""
    if name is None:
        name = architectures()[module]

    def make(res):
        model, x = build(name)
        res.expected, res.expectation = expected_merges(model, x, module)
        res.cls = f"{name} ({x.shape[-1]} px)"
        return model, x, _call

    return run_checks(FamilyResult(module, name), make, timeout, NOTES, build_what=f"timm's {name}")
