"""User-facing errors: a message naming what is wrong and a hint saying how to fix it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypeVar

Model = TypeVar("Model")


class UserError(Exception):
    """An error caused by input (recipe, file, voice, text); the CLI prints it on one line, no traceback."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message

    def __reduce__(self) -> tuple[Any, ...]:  # the hint survives a process boundary (select.py reads MLflow in a child)
        return (type(self), (self.message, self.hint))


def read_json(path: Path, hint: str, name: str | None = None) -> Any:
    """A JSON file that did not come from this code run (fetched, hand-edited, written by another version): any way it
    is unreadable is one UserError naming the file (as `name`, else its path). That includes bad UTF-8, and nesting
    deep enough to exhaust the parser's recursion (a RecursionError, not a ValueError)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise UserError(f"{name or path} is not readable JSON ({type(exc).__name__}: {str(exc)[:200]})", hint) from None


def read_json_object(path: Path, hint: str) -> dict[str, Any]:
    """`read_json`, and it must hold a JSON object."""
    data = read_json(path, hint)
    if not isinstance(data, dict):
        raise UserError(f"{path} holds a JSON {type(data).__name__}, not an object", hint)
    return data


def read_arrays(path: Path, hint: str, required: tuple[str, ...] = ()) -> dict[str, Any]:
    """The arrays of an .npz file that did not come from this code run, loaded whole: any way it is unreadable (a
    missing or truncated file, a bad zip, an object array, which is refused and never unpickled) or a `required`
    array it lacks is one UserError."""
    import zipfile

    import numpy as np

    try:
        _check_sizes(path)
        with np.load(path) as stored:
            arrays = {name: stored[name] for name in stored.files}
    except (OSError, ValueError, EOFError, MemoryError, zipfile.BadZipFile) as exc:
        raise UserError(f"{path} is not readable ({type(exc).__name__}: {str(exc)[:200]})", hint) from None
    missing = [name for name in required if name not in arrays]
    if missing:
        raise UserError(f"{path} has no array {', '.join(repr(m) for m in missing)}", hint)
    return arrays


NPZ_LIMIT = 1 << 30  # bytes an .npz may hold unpacked: an artifact's voices are ~30 MB


def _check_sizes(path: Path) -> None:
    """Refuse an .npz whose arrays would take more than NPZ_LIMIT, or more than their members hold, before
    anything is allocated: a 1 KB file's header can claim an array of 100 GB, a small zip can unpack to gigabytes."""
    import zipfile

    import numpy as np

    with zipfile.ZipFile(path) as archive:
        members = archive.infolist()
        if sum(member.file_size for member in members) > NPZ_LIMIT:
            raise ValueError(f"its arrays unpack to more than {NPZ_LIMIT} bytes")
        for member in members:
            with archive.open(member) as stream:
                version = np.lib.format.read_magic(stream)
                read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                shape, _, dtype = read_header(stream)
                if int(np.prod(shape, dtype=np.float64)) * dtype.itemsize > member.file_size:
                    raise ValueError(f"{member.filename} claims an array of shape {shape}, more than it holds")


def check_torch_file(path: Path) -> Path:
    """A PyTorch file (weights, a voice pack) that `torch.load` can read: a zip archive whose directory is whole.
    Empty or cut short (a killed copy), torch raises EOFError, which the CLI could only report as "Aborted."."""
    import zipfile

    if not zipfile.is_zipfile(path):
        state = "empty" if path.stat().st_size == 0 else "cut short, or not one torch.save wrote"
        raise UserError(f"{path} is not a readable PyTorch file ({state})", "copy or download it again")
    return path


def first_problem(exc: Any) -> str:
    """A pydantic ValidationError's first problem as one phrase: "field 'a.b': what is wrong"."""
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"]) or "(top level)"
    return f"field '{where}': {error['msg'].removeprefix('Value error, ')}"


def read_validated(path: Path, model: type[Model], hint: str) -> Model:
    """`read_json_object`, validated by a pydantic `model`: a file that is not one is one UserError naming the field."""
    from pydantic import ValidationError

    data = read_json_object(path, hint)
    try:
        return model.model_validate(data)  # type: ignore[attr-defined]
    except ValidationError as exc:
        raise UserError(f"{path}: {first_problem(exc)}", hint) from None
