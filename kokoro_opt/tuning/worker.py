"""Entry point of one worker process started by `kokoro-opt tune --workers N`: python -m kokoro_opt.tuning.worker ARGS_JSON."""

from __future__ import annotations

import json
import sys

from rich.console import Console

from kokoro_opt.errors import UserError
from kokoro_opt.tuning.study import WorkerArgs, run_worker


def main(argv: list[str]) -> int:
    args = WorkerArgs(**json.loads(argv[0]))
    err = Console(stderr=True)
    try:
        run_worker(args, say=lambda m: err.print(f"worker {args.index}: {m}", markup=False, highlight=False))
    except UserError as exc:
        err.print(f"worker {args.index}: error: {exc}", markup=False, highlight=False)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
