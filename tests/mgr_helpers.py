"""Helpers shared by the MGR test modules (imported as a sibling module: tests/ has no __init__.py)."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Autouse in every module that imports it: these tests run tiny ops, and one intra-op thread avoids
    waiting on a busy shared CPU for every op."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
