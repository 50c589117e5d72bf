"""User-facing errors: one line that names what is wrong and how to fix it, never a traceback."""

import contextlib
import sys
from collections.abc import Callable
from functools import wraps


class UserError(Exception):
    """A mistake the user can fix (bad config, missing file, unreachable hub).

    Command-line entry points print its message on one line and exit with status 2.
    """


@contextlib.contextmanager
def reading(path, what: str):
    """Reading `path` (a config, a trace, records): a file that cannot be read, or is not UTF-8 text, is a
    one-line error naming it and the fix, not a traceback."""
    try:
        yield
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text ({e.reason}); save the {what} as UTF-8") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read the {what} ({e.strerror or e})") from None


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
