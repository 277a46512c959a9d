"""The model architectures a recipe can train (``model.arch``): LIMe (LLaMA with ``routing="none"``) and
the paper's cross-layer baselines, each a ``LimeConfig`` subclass registered with the Auto classes."""

from __future__ import annotations

from .config import LimeConfig
from .denseformer import DenseFormerConfig
from .hyperconnections import HyperConnectionsConfig
from .resformer import ResFormerConfig

ARCHITECTURES: dict[str, type[LimeConfig]] = {
    "lime": LimeConfig,
    "denseformer": DenseFormerConfig,
    "resformer": ResFormerConfig,
    "hyperconnections": HyperConnectionsConfig,
}


def config_for(arch: str, **fields) -> LimeConfig:
    """The config of architecture ``arch`` with ``fields`` (any LLaMA field, ``routing``, the arch's own)."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; valid: {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[arch](**fields)
