# Triton's CPU interpreter must be chosen before `triton` itself is imported.
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

# the repository root, so that the helpers shared with the benchmarks import as ``benchmarks.models`` / ``benchmarks.timm_import``
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
