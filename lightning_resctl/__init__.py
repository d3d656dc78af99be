"""lightning_resctl: controlled residual connections for PyTorch Lightning.

Merge rules replace the plain residual addition ``out = stream + update``
(:func:`merge_rules` lists them; :func:`register_merge_rule` adds your own):

* :class:`ResController` — a parameter-free, energy-aware merge;
* Multi-Gate Residuals (:class:`MGRChain`) — n gated streams per token;
* the MGR paper's baselines (Attention Residuals, hyper-connections, mHC, mHC-lite).

:func:`patch_residuals` rewrites the residual additions of any model into
one of these merges (reversibly, with a report), and
:class:`ResidualControlCallback` records what the merges do in TensorBoard (or any logger);
:class:`ResidualMonitor` does the same in Fabric and plain PyTorch loops. :func:`compare` answers "does it
help my model?": a matched comparison of the methods on your LightningModule.
"""
from __future__ import annotations

# `compare` and `rescontroller` are the functions, not the submodules of the same names (importing a submodule
# binds the package attribute to the module; these imports rebind it). Submodules stay importable with
# `from lightning_resctl.compare import cli`.
from .compare import compare
from .rules.rescontroller import rescontroller
from .runtime.lazy import lazy_exports as _lazy_exports
from .runtime.triton import triton_available

__version__ = "0.1.0"

# public name -> submodule that defines it (imported on first use, so that
# `import lightning_resctl` stays cheap and does not pull in Lightning/Triton).
_EXPORTS = {
    "ResController": "rules.rescontroller",
    "rescontroller_reference": "rules.rescontroller",
    "rescontroller_scales": "rules.rescontroller",
    "ControllerScales": "rules.rescontroller",
    "MGRChain": "rules.mgr",
    "MGRMerge": "rules.mgr",
    "MGRPool": "rules.mgr",
    "patch_residuals": "surgery",
    "unpatch_residuals": "surgery",
    "PatchReport": "surgery",
    "MergeSite": "surgery",
    "get_patch_report": "surgery",
    "merge_sites": "surgery",
    "parallelize_residuals": "distributed.tensor_parallel",
    "load_unpatched_state_dict": "surgery",
    "patch_from_state_dict": "surgery",
    "patch_from_checkpoint": "surgery",
    "PatchOnLoadMixin": "surgery",
    "from_pretrained": "surgery",
    "ResidualTrainerCallback": "callbacks",
    "MGRRun": "rules.mgr",
    "merge_rules": "rules",
    "register_merge_rule": "rules",
    "get_merge_rule": "rules",
    "MergeRule": "rules",
    "ChainRule": "rules",
    "ResidualControlCallback": "callbacks",
    "ResidualAblationCallback": "callbacks",
    "patch_in_configure_model": "distributed.sharded",
    "ResidualParallelStrategy": "distributed",
    "ResidualMonitor": "diagnostics",
    "ablate": "diagnostics",
    "wait_for_compiles": "runtime.regions",
    "region_calls": "runtime.regions",
    "saved_tensor_bytes": "runtime.memory",
}

__all__ = ["triton_available", "rescontroller", "compare", "__version__", *_EXPORTS]


__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS)

# transformers' Auto classes load patched models' folders (their config.json names the type "lightning_resctl")
from .surgery.hf_auto import register_when_transformers_loads as _register_when_transformers_loads  # noqa: E402

_register_when_transformers_loads()
