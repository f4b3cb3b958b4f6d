"""The console script's entry point: a Ctrl-C while the CLI's modules are still importing ends
as any other Ctrl-C does (one line, exit code 130), not in a traceback. Kept free of imports
so that the window before it can catch anything is as short as Python allows."""

import sys


def main() -> int:
    try:
        from fastrun.runner.cli import EXIT_INTERRUPTED
        from fastrun.runner.cli import console as cli_main
    except KeyboardInterrupt:
        print("fastrun: interrupted", file=sys.stderr)
        return 130
    try:
        return cli_main()
    except KeyboardInterrupt:  # after main's own handlers: while printing or returning
        return EXIT_INTERRUPTED
