"""User errors: one line, exit code 2, nothing written."""

from __future__ import annotations

import argparse
import itertools
import sys


class ConfigError(ValueError):
    """A user's config mistake: reported as one line, exit code 2, nothing written."""


EXIT_BAD_INPUT = 2


def one_line(error: BaseException) -> str:
    """Hydra's and OmegaConf's multi-line messages, folded into one line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    message = lines[0]
    if len(lines) > 1 and lines[1].startswith("Available options"):
        listed = itertools.takewhile(lambda ln: not ln.startswith("Config search path"), lines[2:])
        options = list(listed)
        message += f" (available: {', '.join(options)})"
    if message.startswith("Ambiguous value for argument"):  # a,b: Hydra lists 3 readings
        message += (
            ": for a list write key=[a,b], for a string key='a,b', and to run once per "
            "value add -m (--multirun)"
        )
    # "Error merging override k=v" (and "In 'sweep/x': ... raised while composing config:")
    # keep their reason in the exception they wrap
    cause = str(error.__cause__ or "").strip().splitlines()
    if message.startswith("Error merging override") and cause:
        message += f": {cause[0].strip()}"
        if cause[0].strip() == "list index out of range":  # sweep.stages.5 of a 2-stage sweep
            message += " (the list is shorter: its items count from 0)"
    elif message.endswith(":"):  # its reason is on the next line (or in its cause)
        reason = lines[1] if len(lines) > 1 else (cause[0].strip() if cause else "")
        message = f"{message} {reason}".strip()
    return message


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad argument in one line (its default prints the whole
    usage block first), exit 2 as before."""

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"error: {message} ({self.prog} --help)\n")


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(EXIT_BAD_INPUT)
