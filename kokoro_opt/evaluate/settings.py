"""The evaluation settings of an artifact: its recipe's `evaluate:` section, then overrides."""

from __future__ import annotations

from typing import Any


def evaluate_config(manifest: Any, **overrides: Any) -> Any:
    """The recipe's evaluate settings (from the artifact's manifest, if any), then the overrides that are set."""
    from kokoro_opt.recipe import EvaluateConfig

    stored = ((manifest.recipe if manifest is not None else None) or {}).get("evaluate", {})
    base = EvaluateConfig(**{k: v for k, v in stored.items() if k in EvaluateConfig.model_fields})
    return base.model_copy(update={k: v for k, v in overrides.items() if v is not None})
