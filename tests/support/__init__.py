"""Test-only helpers shared by the tests and the benchmarks (not shipped in the package): :mod:`.models` (the
nanoGPT helpers, a ResNet), :mod:`.timm_import` (timm without torchvision). Imported as ``tests.support...``
with the repository root on ``sys.path`` (tests/conftest.py puts it there; the benchmarks insert it)."""
