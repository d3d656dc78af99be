"""The ResController merge as an ``nn.Module`` (parameter-free; the rule: :mod:`.reference`)."""
from __future__ import annotations

from typing import Optional

from torch import Tensor, nn

from ...runtime.backends import resolve_backend
from ..checks import keywords_or_config
from ..common import check_rule_backend
from .config import ResControllerConfig
from .ops import rescontroller_merge
from .reference import check_dim_type, check_tensors

__all__ = ["ResController"]


class ResController(nn.Module):
    """Parameter-free ResController merge as a module: ``controller(residual, update)``.

    Computes per row along ``dim``: ``out = r + s_u·s_s·u`` where ``s_u`` softly caps the
    update RMS at ``update_ratio·RMS(r)`` and ``s_s`` softly caps the candidate stream RMS
    ``RMS(r + s_u u)`` at ``stream_ratio·RMS(r)`` (full rule: :func:`rescontroller_reference`).

    The options come as keywords or, all of them, as ``config=`` (a :class:`ResControllerConfig`: what the rule
    passes); they are checked once, here.
    """

    def __init__(
        self,
        update_ratio: float = ResControllerConfig.update_ratio,
        stream_ratio: float = ResControllerConfig.stream_ratio,
        update_softness: float = ResControllerConfig.update_softness,
        stream_softness: float = ResControllerConfig.stream_softness,
        eps: float = ResControllerConfig.eps,
        *,
        dim: int = -1,
        backend: str = ResControllerConfig.backend,
        config: Optional[ResControllerConfig] = None,
    ):
        super().__init__()
        keywords = ResControllerConfig(update_ratio, stream_ratio, update_softness, stream_softness, eps, backend)
        config = keywords_or_config("ResController", keywords, config)
        (self.update_ratio, self.stream_ratio, self.update_softness, self.stream_softness, self.eps) = config.math()
        self.dim = check_dim_type(dim)
        self.backend = "auto"
        self.set_backend(config.backend)

    def set_backend(self, name: str) -> "ResController":
        """Choose "auto", "triton" (alias "native"), "torch" ("torch-eager", "torch-compiled") or "reference"
        (see :func:`rescontroller`); returns self."""
        self.backend = check_rule_backend(name)
        return self

    def resolved_backend(self, tensor: Tensor | None = None) -> str:
        """The backend a call on ``tensor`` would use ("triton", "reference" or a "torch" variant)."""
        return resolve_backend(self.backend, tensor)

    def options(self) -> dict:
        """The rule's options (keyword arguments of :func:`rescontroller`, without ``backend``)."""
        return dict(
            update_ratio=self.update_ratio,
            stream_ratio=self.stream_ratio,
            update_softness=self.update_softness,
            stream_softness=self.stream_softness,
            eps=self.eps,
            dim=self.dim,
        )

    def math_options(self) -> tuple[float, ...]:
        """The math options as the dispatch takes them (checked at construction, in
        :attr:`ResControllerConfig.MATH` order)."""
        return self.update_ratio, self.stream_ratio, self.update_softness, self.stream_softness, self.eps

    def forward(self, residual: Tensor, update: Tensor) -> Tensor:
        dim = check_tensors(residual, update, self.dim)
        return rescontroller_merge(residual, update, self.math_options(), dim, self.backend)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.options().items()) + f", backend={self.backend!r}"

