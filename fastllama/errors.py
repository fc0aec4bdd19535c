"""What every command line here shares: the user-error type and the wrapper that prints it as one line."""

import signal
import sys
import threading


class UserError(Exception):
    """A problem with what the user asked for or gave us: the CLIs print it as one line."""


def refuse(message: str):
    """A bad combination of arguments, found before run_cli runs: one line on stderr and exit code 1, as
    a UserError gives (argparse's own errors, an unknown flag say, print its usage and exit with 2)."""
    sys.exit(f"error: {message}")


def run_cli(main, args):
    """Run a CLI's main, turning user errors into one line on stderr and exit code 1. SIGTERM and SIGHUP
    (kill, timeout, a closed terminal) end it as Ctrl-C does, through every cleanup on the way out
    (no half-written file: checkpoint.write_atomically)."""
    if threading.current_thread() is threading.main_thread():  # where Python lets a handler be set
        for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
            if sig is not None:
                signal.signal(sig, lambda number, frame: sys.exit(128 + number))
    try:
        main(args)
    except UserError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit(130)
