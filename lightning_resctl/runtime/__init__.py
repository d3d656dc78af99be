"""How a merge rule's math runs; knows no rule (rules import it, never the other way round).

* :mod:`.backends` — backend names (:data:`~.backends.BACKENDS`), :func:`~.backends.check_backend`, the one
  resolver :func:`~.backends.resolve_backend`, :func:`~.backends.torch_mode`;
* :mod:`.triton` — :func:`~.triton.load_kernels` (the only way to a rule's kernels module), the one "can Triton
  run here" check :func:`~.triton.triton_runs_on`, :func:`~.triton.triton_available`;
* :mod:`.autograd` — autocast-proof products, the closed-form paths' refusals, custom-op outputs;
* :mod:`.tracer`, :mod:`.regions`, :mod:`.background` — the compiled CPU regions: the tracer, the regions, and the
  background compiler (which imports the tracer only);
* :mod:`.memory` — :func:`~.memory.saved_tensor_bytes`; :mod:`.log` — the package's logger.

The names below are re-exported here lazily (importing one submodule, e.g. the background compiler's child,
imports no other).
"""
from __future__ import annotations

from .lazy import lazy_exports as _lazy_exports

# public name -> submodule that defines it (imported on first use)
_EXPORTS = {
    **dict.fromkeys(("BACKENDS", "RULE_BACKENDS", "ALIASES", "COMPILE_ENV", "check_backend", "resolve_backend",
                     "cpu_compile_available", "torch_mode", "exporting_for_training"), "backends"),
    **dict.fromkeys(("load_kernels", "interpreter_mode", "triton_available", "triton_runs_on"), "triton"),
    **dict.fromkeys(("autocast_off", "fp32_matmul", "fp32_bmm", "refuse_transforms", "refuse_second_derivative"),
                    "autograd"),
    **dict.fromkeys(("COMPILE_LOCK", "trace_region"), "tracer"),
    **dict.fromkeys(("CompiledMath", "CompiledRegion", "wait_for_compiles", "region_calls"), "regions"),
    "saved_tensor_bytes": "memory",
    "rank_zero_line": "log",
}

__all__ = list(_EXPORTS)


__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS)
