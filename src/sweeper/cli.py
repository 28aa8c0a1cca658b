"""Command-line plumbing shared by the entry points: config composition with one-line
errors. Hydra's own error output is several lines plus a hint about HYDRA_FULL_ERROR;
users get one line naming the problem and exit code 2 instead."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from sweeper.config import ConfigError

EXIT_BAD_INPUT = 2


def compose(overrides: Sequence[str]):
    """Compose conf/ with Hydra's compose API (no run dir, no files written)."""
    import yaml
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from sweeper.paths import config_dir

    try:
        with initialize_config_dir(str(config_dir()), version_base="1.3"):
            return hydra_compose("config", overrides=list(overrides))
    except (HydraException, OmegaConfBaseException, ValueError) as error:
        raise ConfigError(one_line(error)) from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"{mark.name}, line {mark.line + 1}" if mark else "a config file"
        problem = getattr(error, "problem", None) or one_line(error)
        raise ConfigError(f"YAML syntax error in {where}: {problem}") from None


def one_line(error: BaseException) -> str:
    """Hydra's and OmegaConf's multi-line messages, folded into one line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    message = lines[0]
    if len(lines) > 1 and lines[1].startswith("Available options"):
        options = []
        for line in lines[2:]:
            if line.startswith("Config search path"):
                break
            options.append(line)
        message += f" (available: {', '.join(options)})"
    return message


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(EXIT_BAD_INPUT)
