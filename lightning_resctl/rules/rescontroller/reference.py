"""ResController: a parameter-free, energy-aware replacement for the residual merge ``r + u``.

The rule (per row, i.e. along the feature dimension ``dim``; d = its size; all
arithmetic in fp32, or fp64 when an input is fp64, also under ``torch.autocast``)::

    R      = sqrt(mean(r^2) + eps)                # residual RMS
    U      = sqrt(mean(u^2) + eps)                # update RMS
    A_u    = update_ratio * R                     # allowed update RMS
    hard_u = min(A_u / (U + eps), 1)
    p_u    = U / (A_u + eps)                      # update pressure
    g_u    = sigmoid(update_softness * (p_u - 1))
    s_u    = 1 - g_u * (1 - hard_u)               # "alpha"
    C      = sqrt(max((Σr² + 2 s_u Σru + s_u² Σu²) / d, 0) + eps)   # RMS of r + s_u u
    A_s    = stream_ratio * R                     # allowed stream RMS
    hard_s = min(A_s / (C + eps), 1)
    p_s    = C / (A_s + eps)
    g_s    = sigmoid(stream_softness * (p_s - 1))
    s_s    = 1 - g_s * (1 - hard_s)               # "beta"
    out    = r + (s_u * s_s) * u                  # in the input dtype

Three execution paths compute it (this module: the rule's formula and the oracle; :mod:`.ops`: the other two):

* :func:`rescontroller_reference` — the rule in plain torch ops (the oracle every other
  path is tested against; plain autograd differentiates it; ``backend="reference"``);
* the lean torch path — :class:`_ResControllerFunction`, an ``autograd.Function`` whose
  backward is the closed-form derivative of the rule; it saves only ``r``, ``u`` and a few
  per-row scalars (plain autograd of the reference saves every intermediate);
* the Triton path — fused forward and backward kernels in ``lightning_resctl.kernels.rescontroller``,
  registered as ``torch.library`` custom ops (opaque to ``torch.compile``).

:func:`rescontroller` / :class:`ResController` validate the input and dispatch:
``backend="auto"`` picks Triton for CUDA tensors when Triton works, else the torch path. The torch and Triton
paths refuse double backward, forward-mode AD and the ``torch.func`` transforms (their backward is closed-form)
with an error naming ``backend="reference"``, which supports them.
"""
from __future__ import annotations

import numbers
from typing import NamedTuple

import torch
from torch import Tensor

from ...runtime.autograd import autocast_off
from ..common import compute_dtype
from .config import ResControllerConfig

__all__ = ["ControllerScales", "rescontroller_reference", "rescontroller_scales", "SCALE_THRESHOLD", "check_dim_type",
           "check_tensors", "row_inv_scale",
           "reference_merge"]


class ControllerScales(NamedTuple):
    """Per-row scales of the rule (fp32, the feature dim reduced away)."""

    alpha: Tensor  # s_u, the update scale
    beta: Tensor  # s_s, the stream scale
    update_cap_active: Tensor  # bool, p_u > 1
    stream_cap_active: Tensor  # bool, p_s > 1


# --------------------------------------------------------------------------------------------
# validation of the tensors (the options are checked by ResControllerConfig)
# --------------------------------------------------------------------------------------------
def check_dim_type(dim) -> int:
    """``dim`` as an int (TypeError for a bool or a non-integer)."""
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
        raise TypeError(f"dim must be an int, got {dim!r} ({type(dim).__name__})")
    return int(dim)


def _check_dim(dim, ndim: int) -> int:
    dim = check_dim_type(dim)
    if ndim == 0:
        raise ValueError("residual must have at least one dimension (the feature dim), got a 0-d tensor")
    if not -ndim <= dim < ndim:
        raise ValueError(f"dim={dim} is out of range for tensors with {ndim} dimensions")
    return dim % ndim


def check_tensors(residual, update, dim) -> int:
    """Check a merge's two tensors (same shape, floating point, one device, a non-empty feature dim ``dim``);
    returns ``dim`` normalised to ``0..ndim-1``."""
    for name, t in (("residual", residual), ("update", update)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must have a floating-point dtype, got {t.dtype}")
    if residual.shape != update.shape:
        raise ValueError(
            f"residual and update must have the same shape (nothing is broadcast), "
            f"got residual {tuple(residual.shape)} and update {tuple(update.shape)}"
        )
    if residual.device != update.device:
        raise ValueError(
            f"residual and update must be on the same device, got residual on {residual.device} "
            f"and update on {update.device}"
        )
    dim = _check_dim(dim, residual.dim())
    if residual.shape[dim] == 0:
        raise ValueError(f"the feature dim (dim={dim}) must not be empty, got shape {tuple(residual.shape)}")
    return dim


# --------------------------------------------------------------------------------------------
# row scaling: the moments of rows of magnitude >= 2^32 are taken of r / k, u / k
# --------------------------------------------------------------------------------------------
#: Rows whose max-abs reaches this are scaled down before squaring (below it, k = 1: nothing changes).
SCALE_THRESHOLD = 2.0 ** 32


def row_inv_scale(r: Tensor, u: Tensor, dim: int) -> Tensor:
    """Per row (keepdim) ``1 / k`` with ``k`` a power of two near the row's max-abs when that is >= 2^32, else 1.

    The rule is scale-invariant except for ``eps``, so computing it on ``r / k``, ``u / k`` with ``eps / k^2``
    inside square roots and ``eps / k`` beside the RMS values gives the same result without overflowing the
    squares (rows ~1e20 in fp32); powers of two scale exactly. Non-finite rows keep k = 1 (NaN/inf propagate
    as before). Not differentiated: the result does not depend on k."""
    with torch.no_grad():
        mx = torch.maximum(torch.linalg.vector_norm(r, float("inf"), dim=dim, keepdim=True),
                           torch.linalg.vector_norm(u, float("inf"), dim=dim, keepdim=True))
        big = (mx >= SCALE_THRESHOLD) & (mx < float("inf"))
        return torch.where(big, torch.exp2(-torch.floor(torch.log2(mx))), torch.ones_like(mx))


# --------------------------------------------------------------------------------------------
# the oracle
# --------------------------------------------------------------------------------------------
def _reference_scales(r: Tensor, u: Tensor, ur, sr, ku, ks, eps, dim: int):
    """The spec's per-row chain in plain torch ops (keepdim); returns (s_u, s_s, p_u, p_s).

    Rows of magnitude >= 2^32 are computed on ``r / k``, ``u / k`` (see :func:`row_inv_scale`): ``eps2`` is
    eps inside square roots, ``eps1`` eps beside the RMS values (both ``eps`` when k = 1)."""
    inv_k = row_inv_scale(r, u, dim)
    r, u = r * inv_k, u * inv_k
    eps1 = eps * inv_k
    eps2 = eps1 * inv_k
    mrr = (r * r).mean(dim, keepdim=True)
    muu = (u * u).mean(dim, keepdim=True)
    mru = (r * u).mean(dim, keepdim=True)
    R = torch.sqrt(mrr + eps2)
    U = torch.sqrt(muu + eps2)
    A_u = ur * R
    hard_u = (A_u / (U + eps1)).clamp(max=1.0)
    p_u = U / (A_u + eps1)
    g_u = torch.sigmoid(ku * (p_u - 1.0))
    s_u = 1.0 - g_u * (1.0 - hard_u)
    # RMS of the candidate stream r + s_u u, from the three row moments
    C = torch.sqrt((mrr + 2.0 * s_u * mru + s_u * s_u * muu).clamp(min=0.0) + eps2)
    A_s = sr * R
    hard_s = (A_s / (C + eps1)).clamp(max=1.0)
    p_s = C / (A_s + eps1)
    g_s = torch.sigmoid(ks * (p_s - 1.0))
    s_s = 1.0 - g_s * (1.0 - hard_s)
    return s_u, s_s, p_u, p_s


def rescontroller_reference(
    residual: Tensor,
    update: Tensor,
    update_ratio: float = ResControllerConfig.update_ratio,
    stream_ratio: float = ResControllerConfig.stream_ratio,
    update_softness: float = ResControllerConfig.update_softness,
    stream_softness: float = ResControllerConfig.stream_softness,
    eps: float = ResControllerConfig.eps,
    *,
    dim: int = -1,
) -> Tensor:
    """The ResController rule in plain torch ops — the oracle the other paths are tested against.

    Per row along ``dim`` (d = its size), in fp32 (fp64 when an input is fp64)::

        R = sqrt(mean(r²) + eps)              U = sqrt(mean(u²) + eps)
        A_u = update_ratio·R                  hard_u = min(A_u / (U + eps), 1)
        p_u = U / (A_u + eps)                 g_u = sigmoid(update_softness·(p_u − 1))
        s_u = 1 − g_u·(1 − hard_u)
        C = sqrt(max(mean(r²) + 2 s_u mean(ru) + s_u² mean(u²), 0) + eps)
        A_s = stream_ratio·R                  hard_s = min(A_s / (C + eps), 1)
        p_s = C / (A_s + eps)                 g_s = sigmoid(stream_softness·(p_s − 1))
        s_s = 1 − g_s·(1 − hard_s)
        out = r + (s_u·s_s)·u                 (in the promoted input dtype)

    Differentiable by plain autograd (which saves every intermediate).
    """
    dim = check_tensors(residual, update, dim)
    opts = ResControllerConfig(update_ratio, stream_ratio, update_softness, stream_softness, eps).math()
    return reference_merge(residual, update, opts, dim)


def reference_merge(residual: Tensor, update: Tensor, opts: tuple, dim: int) -> Tensor:
    """:func:`rescontroller_reference` on checked arguments: ``opts`` = :meth:`ResControllerConfig.math`, ``dim``
    as :func:`check_tensors` returns it (what the dispatch runs for ``backend="reference"``)."""
    ur, sr, ku, ks, eps = opts
    cdt = compute_dtype(residual, update)
    with autocast_off(residual.device.type):
        r, u = residual.to(cdt), update.to(cdt)
        s_u, s_s, _, _ = _reference_scales(r, u, ur, sr, ku, ks, eps, dim)
        out = r + (s_u * s_s) * u
    return out.to(torch.promote_types(residual.dtype, update.dtype))


def rescontroller_scales(
    residual: Tensor,
    update: Tensor,
    update_ratio: float = ResControllerConfig.update_ratio,
    stream_ratio: float = ResControllerConfig.stream_ratio,
    update_softness: float = ResControllerConfig.update_softness,
    stream_softness: float = ResControllerConfig.stream_softness,
    eps: float = ResControllerConfig.eps,
    *,
    dim: int = -1,
) -> ControllerScales:
    """Per-row scales of the rule (no grad): ``alpha`` = s_u, ``beta`` = s_s, and whether the
    update cap (p_u > 1) and the stream cap (p_s > 1) are active. Tensors of shape
    ``residual.shape`` with ``dim`` removed; alpha/beta in fp32."""
    dim = check_tensors(residual, update, dim)
    ur, sr, ku, ks, eps = ResControllerConfig(update_ratio, stream_ratio, update_softness, stream_softness, eps).math()
    cdt = compute_dtype(residual, update)
    with torch.no_grad(), autocast_off(residual.device.type):
        r, u = residual.detach().to(cdt), update.detach().to(cdt)
        s_u, s_s, p_u, p_s = _reference_scales(r, u, ur, sr, ku, ks, eps, dim)
        return ControllerScales(
            alpha=s_u.squeeze(dim).float(),
            beta=s_s.squeeze(dim).float(),
            update_cap_active=(p_u > 1.0).squeeze(dim),
            stream_cap_active=(p_s > 1.0).squeeze(dim),
        )

