"""Inference-settings tuning (`kokoro-opt tune`): an Optuna study over ORT session options, chunking and
the artifacts within the quality budget; the winner goes to tuned.json for `serve --artifact best`.

Modules: config (the recipe), space (artifacts, providers, sampling), measure (TTFA/RTF the server's
way), study (Optuna storage, objective, workers), records (MLflow, plots), report (pick, table,
tuned.json), run (the command). See docs/tuning.md.
"""
