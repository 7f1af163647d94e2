"""The evaluation settings of an artifact: its recipe's `evaluate:` section, then overrides."""

from __future__ import annotations

from typing import Any


def evaluate_config(manifest: Any, **overrides: Any) -> Any:
    """The recipe's evaluate settings (from the artifact's manifest, if any), then the overrides that are set."""
    from pydantic import ValidationError

    from kokoro_opt.errors import UserError
    from kokoro_opt.recipe import CORPUS_SENTENCES, EvaluateConfig

    stored = ((manifest.recipe if manifest is not None else None) or {}).get("evaluate", {})
    base = {k: v for k, v in stored.items() if k in EvaluateConfig.model_fields}
    if isinstance(base.get("sentences"), int) and base["sentences"] > CORPUS_SENTENCES:  # an older build's: it read 48
        base["sentences"] = CORPUS_SENTENCES
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        return EvaluateConfig(**{**base, **given})  # validated: --runs 0 is refused, not run
    except ValidationError as exc:
        problems = "; ".join(f"--{'.'.join(map(str, e['loc']))} {e['msg'].lower()}" for e in exc.errors())
        raise UserError(f"evaluation settings: {problems}", "see the command's --help") from None
