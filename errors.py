"""What every command line here shares: the user-error type and the wrapper that prints it as one line."""

import sys


class UserError(Exception):
    """A problem with what the user asked for or gave us: the CLIs print it as one line."""


def refuse(message: str):
    """A bad combination of arguments, found before run_cli runs: one line on stderr and exit code 1, as
    a UserError gives (argparse's own errors, an unknown flag say, print its usage and exit with 2)."""
    sys.exit(f"error: {message}")


def run_cli(main, args):
    """Run a CLI's main, turning user errors into one line on stderr and exit code 1."""
    try:
        main(args)
    except UserError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit(130)
