"""Recipe files: YAML that must hold a mapping, `extends:` merged key by key, `append_stages:`, and pydantic's
problems said as one line per field. Build recipes (recipe.py) and tuning recipes (tuning/config.py) read through it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from kokoro_opt.errors import UserError


def _deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


BUILD_ONLY, TUNING_ONLY = {"stages", "weights", "export"}, {"study", "storage", "trials", "space", "measure"}


def require_kind(data: dict[str, Any], path: Path, kind: str) -> None:
    """Refuse a recipe of the other kind ("build" or "tuning"), told by fields only that kind has: given to the
    wrong command it would fail on its first unknown field, a message that does not say what happened."""
    build, tuning = not BUILD_ONLY.isdisjoint(data), not TUNING_ONLY.isdisjoint(data)
    if kind == "build" and tuning and not build:
        raise UserError(f"{path} is a tuning recipe, not a build recipe", "kokoro-opt tune it; build recipes/int8-mixed.yaml")
    if kind == "tuning" and build and not tuning:
        raise UserError(f"{path} is a build recipe, not a tuning recipe", "kokoro-opt build it; tune e.g. recipes/tune-cpu.yaml")


NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]*$"  # a recipe's name names its folder (artifacts/<name>, a study)


def name_from_file(data: dict[str, Any], path: Path) -> None:
    """A recipe without `name:` is named after its file; a file name that is not a plain name is refused as such."""
    if "name" not in data and not re.fullmatch(NAME_PATTERN, path.stem):
        raise UserError(
            f"{path}: a recipe without name: is named after its file, and {path.stem!r} is not a plain name",
            "add name: (lowercase letters, digits, '.', '_', '-'), or rename the file",
        )
    data.setdefault("name", path.stem)


class _UniqueKeys(yaml.SafeLoader):
    """YAML's safe loader, except that a key given twice in one mapping is an error: PyYAML keeps the last one, so
    a second `stages:` further down would silently replace the first."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if not isinstance(key, str | int | float | bool | None):  # `? [a, b]`: no recipe field is named so
                raise yaml.constructor.ConstructorError(None, None, f"a key on line {line} is a {type(key).__name__}, not a name")
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"'{key}' is given twice (lines {seen[key]} and {line})")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def read_yaml_mapping(path: Path, kind: str, example: str) -> dict[str, Any]:
    """A YAML file that must hold a mapping; every problem is one UserError naming the file."""
    if path.is_dir():
        raise UserError(f"{path} is a folder, not a {kind} file", f"pass a .yaml file, e.g. {example}")
    if not path.is_file():
        raise UserError(f"{kind} file not found: {path}", f"pass an existing .yaml file, e.g. {example}")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeys)
    except yaml.YAMLError as exc:
        raise UserError(f"{path} is not valid YAML: {exc}".replace("\n", " "), "fix the YAML syntax") from exc
    except RecursionError:
        raise UserError(f"{path} nests too deep to read", "a recipe is a few levels of mappings and lists") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"{path} is not UTF-8 text (byte {exc.start})", "save it as UTF-8") from None
    if data is None:  # an empty file (or comments only) would build or tune the defaults, unasked
        raise UserError(f"{path} is empty: it names no {kind} fields", f"see {example} for the layout")
    if not isinstance(data, dict):
        raise UserError(f"{path} must be a YAML mapping of {kind} fields", f"see {example} for the layout")
    return data


def read_recipe_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A recipe file's fields with its `extends:` parents merged under them and `append_stages:` added to `stages`."""
    if path.resolve() in seen:
        raise UserError(f"recipe {path} extends itself through {' -> '.join(str(p) for p in seen)}")
    data = read_yaml_mapping(path, "recipe", "recipes/fp32.yaml")
    weights = data.get("weights")
    if isinstance(weights, dict) and isinstance(weights.get("path"), str):  # as `extends:`, from the recipe's folder
        weights["path"] = str((path.parent / Path(weights["path"]).expanduser()).resolve())
    parent = data.pop("extends", None)
    extra_stages = data.pop("append_stages", None)
    if parent is not None:
        if not isinstance(parent, str):
            raise UserError(f"{path}: field 'extends' must be one recipe file", "write extends: fp32.yaml")
        parent_path = (path.parent / parent).resolve()
        if not parent_path.is_file():
            raise UserError(f"{path}: extends {parent}, which is not a file ({parent_path})", "fix the extends: path")
        inherited = read_recipe_yaml(parent_path, (*seen, path.resolve()))
        inherited.pop("name", None)  # another recipe: its own name (default: its file's), its own artifacts folder
        data = _deep_merge(inherited, data)
    if extra_stages is not None:
        if not isinstance(extra_stages, list):
            raise UserError(f"{path}: field 'append_stages' must be a list of stages", "write it like 'stages'")
        stages = data.get("stages") or []
        if not isinstance(stages, list):
            raise UserError(f"{path}: field 'stages' must be a list of stages", "append_stages adds to that list")
        data["stages"] = [*stages, *extra_stages]
    return data


def explain(error: Any) -> str:
    """One pydantic problem in a recipe's words: the field, what is wrong, and for a typo how to fix it."""
    where = ".".join(str(p) for p in error["loc"]) or "recipe"
    kind = error["type"]
    if kind == "extra_forbidden":
        return f"unknown field '{where}': remove it or check its spelling"
    if kind == "missing":
        return f"missing field '{where}': add it to the recipe"
    if kind == "value_error":  # our own validators: the message says it all, the input is the whole section
        message = error["msg"].removeprefix("Value error, ")
        return f"field '{where}': {message}" if error["loc"] else message
    if kind in ("literal_error", "union_tag_invalid"):
        return f"field '{where}': {error['msg']}"
    got = repr(error.get("input"))  # a whole section when the wrong kind of file is given (a lock): the start of it
    return f"field '{where}': {error['msg']} (got {got if len(got) <= 80 else got[:77] + '...'})"
