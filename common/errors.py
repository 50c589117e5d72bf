"""User-facing errors: one line that names what is wrong and how to fix it, never a traceback."""

import sys
from collections.abc import Callable
from functools import wraps


class UserError(Exception):
    """A mistake the user can fix (bad config, missing file, unreachable hub).

    Command-line entry points print its message on one line and exit with status 2.
    """


def cli_entry(main: Callable[..., int | None]) -> Callable[..., int]:
    """Wrap a console-script `main` so that UserError becomes `error: ...` and exit code 2."""

    @wraps(main)
    def wrapper(*args, **kwargs) -> int:
        try:
            rc = main(*args, **kwargs)
        except UserError as e:
            for line in str(e).splitlines() or [""]:
                print(f"error: {line}", file=sys.stderr)
            sys.exit(2)
        except KeyboardInterrupt:
            sys.exit(130)
        sys.exit(rc or 0)

    return wrapper
