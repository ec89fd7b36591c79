"""Command-line plumbing: bad input is reported in one line, before any model is built."""

from __future__ import annotations

import sys
from pathlib import Path


class ConfigError(ValueError):
    """Bad user input (a flag, a file, a row of a file)."""


class NonFiniteError(RuntimeError):
    """A loss or gradient norm that is NaN or infinite: the run stopped before the optimiser step that would take it."""


def check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def run(main, args) -> None:
    """Call main(args); a ConfigError becomes `<script>: error: <message>` and exit status 2, a NonFiniteError the same
    line and exit status 1. However main ends, the distributed process group (the Accelerator's, with several
    processes) is destroyed here, not left to the interpreter's exit, where a live gloo group can abort the process."""
    try:
        main(args)
    except (ConfigError, NonFiniteError) as e:
        print(f"{Path(sys.argv[0]).name}: error: {e}", file=sys.stderr)
        sys.exit(2 if isinstance(e, ConfigError) else 1)
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
