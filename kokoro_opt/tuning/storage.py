"""Where a study lives: Optuna's RDB storage (an SQLite file alone, PostgreSQL for a team), opened with the timeouts
its workers need and refused when it is something else (MLflow's store), and optuna itself, imported quietly."""

from __future__ import annotations

import warnings
from typing import Any

from kokoro_opt.errors import UserError
from kokoro_opt.paths import database_for_messages, sqlite_file
from kokoro_opt.tuning.config import WorkersConfig


def load_optuna() -> Any:
    """optuna, imported when a command needs it, its logging and experimental-feature warnings quieted."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)  # failures are reported by us, once, without tracebacks
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    return optuna


# database drivers that take libpq's or MySQL's `connect_timeout` (the URL's own setting is kept)
_TIMED_DRIVERS = ("postgresql", "postgresql+psycopg2", "postgresql+psycopg", "mysql", "mysql+pymysql", "mysql+mysqldb")


def make_storage(url: str, workers: WorkersConfig | None = None) -> Any:
    optuna = load_optuna()
    kwargs: dict[str, Any] = {}
    if (db := sqlite_file(url)) is not None:
        db.parent.mkdir(parents=True, exist_ok=True)
        url = f"sqlite:///{db}" + (f"?{url.partition('?')[2]}" if "?" in url else "")
        kwargs = {"connect_args": {"timeout": 60}}  # several worker processes write to one file
    elif url.split(":", 1)[0] in _TIMED_DRIVERS and "connect_timeout" not in url:  # a server that never answers
        kwargs = {"connect_args": {"connect_timeout": 15}}
    try:
        _not_a_tracking_store(url, kwargs)
        beat = workers or WorkersConfig()
        return _open_rdb(optuna, url, kwargs, beat)
    except ImportError as exc:
        raise UserError(f"cannot open storage {url.split('://')[0]}://...: {exc}", "install its database driver") from None
    except UserError:
        raise
    except Exception as exc:  # sqlalchemy's URL and connection errors
        raise UserError(
            f"cannot open the Optuna storage: {type(exc).__name__}: {exc}".splitlines()[0], "check --storage"
        ) from None


def _not_a_tracking_store(url: str, engine_kwargs: dict[str, Any]) -> None:
    """Optuna would add its tables to any database it is given, MLflow's too (its file sits beside the study's in
    experiments/), and then fail on MLflow's alembic version as an "incompatible schema"."""
    from kokoro_opt.evaluate.tracking_schema import holds_mlflow_tables

    if (db := sqlite_file(url)) is not None and not (db.is_file() and db.stat().st_size):
        return  # a new file: nothing in it yet
    if holds_mlflow_tables(url, engine_kwargs):
        raise UserError(
            f"--storage {database_for_messages(url)} is an MLflow tracking store, not an Optuna storage: nothing was "
            "written to it",
            "give the study its own database, e.g. sqlite:///experiments/optuna.db",
        )


def _open_rdb(optuna: Any, url: str, engine_kwargs: dict[str, Any], beat: WorkersConfig, attempts: int = 5) -> Any:
    """RDBStorage, opened again when another worker was creating the same new database's tables at that moment:
    PostgreSQL then refuses the second CREATE (UniqueViolation on pg_type), SQLite says the table already exists,
    and the tables exist a moment later. Seen when two `tune` runs or workers opened a fresh study database together."""
    import time

    from sqlalchemy.exc import IntegrityError, OperationalError

    def storage() -> Any:
        return optuna.storages.RDBStorage(
            url, engine_kwargs=engine_kwargs, heartbeat_interval=beat.heartbeat_seconds, grace_period=beat.stale_after_seconds
        )

    for _ in range(attempts - 1):
        try:
            return storage()
        except IntegrityError:
            time.sleep(0.5)
        except OperationalError as exc:
            if "already exists" not in str(exc):
                raise
            time.sleep(0.5)
    return storage()
