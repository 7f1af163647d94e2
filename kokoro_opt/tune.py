"""Public API of `kokoro-opt tune` (the implementation lives in kokoro_opt.tuning)."""

from kokoro_opt.tuning.config import TuneRecipe, load_tune_recipe, parse_tune_recipe
from kokoro_opt.tuning.measure import Comparison, SessionCache, compare_with_defaults
from kokoro_opt.tuning.run import TuneResult, run_tuning, show_front
from kokoro_opt.tuning.space import TrialSettings

__all__ = [
    "Comparison",
    "SessionCache",
    "TrialSettings",
    "TuneRecipe",
    "TuneResult",
    "compare_with_defaults",
    "load_tune_recipe",
    "parse_tune_recipe",
    "run_tuning",
    "show_front",
]
