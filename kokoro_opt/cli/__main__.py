"""`python -m kokoro_opt.cli`: the `kokoro-opt` command."""

from kokoro_opt.cli import main

main()
