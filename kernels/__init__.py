"""Triton kernels of lightning_resctl and their ``torch.library`` op registration.

Installed as ``lightning_resctl.kernels``. Only Triton code and op registration
live here; the math each kernel computes is stated (and implemented as the torch
reference that tests check the kernels against) in ``lightning_resctl``.
"""
