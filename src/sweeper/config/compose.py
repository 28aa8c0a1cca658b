"""Command-line plumbing shared by the entry points: config composition with one-line
errors. Hydra's own error output is several lines plus a hint about HYDRA_FULL_ERROR;
users get one line naming the problem and exit code 2 instead."""

from __future__ import annotations

import difflib
import re
import warnings
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

from sweeper.config.errors import ConfigError, one_line
from sweeper.config.schema import BUDGET_KEYS
from sweeper.config.sweep import KINDS, BohbSpec, BudgetSpec, StageSpec, SweepSpec


def compose(overrides: Sequence[str]):
    """Compose conf/ with Hydra's compose API (no run dir, no files written)."""
    import yaml
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    check_syntax(overrides)
    try:
        return resolved(_hydra_compose(overrides))
    # TypeError: OmegaConf's for a list index that is not a number (sweep.stages.x.name=...)
    except (HydraException, OmegaConfBaseException, ValueError, TypeError) as error:
        message = unknown_key_message(error, overrides) or one_line(error)
        message += misplaced_file_hint(message, overrides)
        if "Could not override 'sweep'" in message:  # sweep is no default group to override
            chosen = next((o for o in overrides if o.startswith("sweep=")), "sweep=NAME")
            message += f" A sweep is added, not overridden: write +{chosen}"
        if isinstance(error, TypeError):
            message = f"{first_failing(overrides) or 'an override'}: {message}"
        raise ConfigError(message) from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"{mark.name}, line {mark.line + 1}" if mark else "a config file"
        problem = getattr(error, "problem", None) or one_line(error)
        raise ConfigError(f"YAML syntax error in {where}: {problem}") from None


def misplaced_file_hint(message: str, overrides: Sequence[str]) -> str:
    """Where Hydra found no `sweep/NAME` but a search path dir holds NAME.yaml at its top:
    the file is one folder too high, which Hydra's message does not say."""
    missing = re.search(r"Could not find '(\w+)/([^'/]+)'", message)
    if not missing:
        return ""
    group, name = missing.groups()
    for override in overrides:
        if not override.lstrip("+").startswith("hydra.searchpath="):
            continue
        for root in re.findall(r"file://([^,\]\s'\"]+)", override):
            if (Path(root) / f"{name}.yaml").is_file():
                return (
                    f"; {Path(root) / name}.yaml is at the search path's top: Hydra reads a "
                    f"{group} file from {Path(root) / group / name}.yaml"
                )
    return ""


def resolved(cfg):
    """`cfg` once every ${...} in it resolves (Hydra composes without resolving): a typo in
    one is the key that holds it and why, in one line."""
    from omegaconf import OmegaConf
    from omegaconf.errors import InterpolationResolutionError

    try:
        OmegaConf.to_container(cfg, resolve=True)
    except InterpolationResolutionError as error:
        where = getattr(error, "full_key", None)
        text = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ConfigError(f"{where}: {text}" if where else text) from None
    return cfg


def _hydra_compose(overrides: Sequence[str], return_hydra_config: bool = False):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from sweeper.config.paths import config_dir

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with initialize_config_dir(str(config_dir()), version_base="1.3"):
                cfg = hydra_compose(
                    "config", overrides=list(overrides), return_hydra_config=return_hydra_config
                )
                failure = None
        except Exception as error:  # raised below, after the search path's check
            cfg, failure = None, error
    # Hydra warns (two lines, from its own source) of a search path it cannot find, then
    # composes without it: the config dir that is not there is the error, before what it
    # would have held ("Could not find 'sweep/mine'")
    for warning in caught:
        text = str(warning.message)
        if "is not available" in text and "hydra.searchpath" in text:
            path = text.split("path=", 1)[-1].split(" is not available")[0]
            raise ConfigError(f"hydra.searchpath: no config dir at {path}")
        warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    if failure is not None:
        raise failure
    return cfg


# Hydra's own dirs: new each time (named by the clock), so nothing there to protect
HYDRA_DEFAULT_DIRS = frozenset(
    {"outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}", "multirun/${now:%Y-%m-%d}/${now:%H-%M-%S}"}
)


def hydra_setting(overrides: Sequence[str], key: str):
    """`key` of Hydra's own config (hydra.run.dir, hydra.sweep.dir, hydra.job.chdir) as the
    job will read it, resolved, wherever it was set: on the command line, quoted or not, in
    a sweep file, or through an interpolation (`${sweep.name}`, `${oc.env:DIR}`); the
    command line alone misses the last three. None at Hydra's default dirs."""
    from omegaconf import OmegaConf

    try:
        cfg = _hydra_compose(overrides, return_hydra_config=True)
    except Exception:  # a -m product (`a,b`) or another sweeper plugin's syntax
        return _as_typed(overrides, key)
    parent, _, leaf = key.rpartition(".")
    written = OmegaConf.to_container(OmegaConf.select(cfg, parent), resolve=False).get(leaf)
    if written is None or written in HYDRA_DEFAULT_DIRS:
        return None
    try:
        return OmegaConf.select(cfg, key, throw_on_resolution_failure=True)
    except Exception:  # `${hydra:...}`: only a running Hydra resolves it
        return written


def _as_typed(overrides: Sequence[str], key: str) -> str | None:
    """`key` as the command line sets it (the last setting wins), its quotes removed."""
    values = [o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith(f"{key}=")]
    if not values:
        return None
    value = values[-1]
    quoted = len(value) >= 2 and value[0] == value[-1] and value[0] in "'\""
    return value[1:-1] if quoted else value


def check_syntax(overrides: Sequence[str]) -> None:
    """Parse each override alone, so a syntax error names the override it is in (Hydra's
    parser reports only the position: "no viable alternative at input '[1'")."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    for override in overrides:
        if override.startswith("--"):  # Hydra's own flags are read before overrides
            raise ConfigError(
                f"unknown option '{override}': the options are in --help; a config value is "
                "set as key=value"
            )
        try:
            parser.parse_overrides([override])
        except OverrideParseException as error:
            lines = [line.strip() for line in str(error).splitlines() if line.strip()]
            detail = [
                line
                for line in lines
                if not line.startswith(("See https://", "Error parsing override"))
            ]
            raise ConfigError(
                f"cannot parse override '{override}': {'; '.join(detail) or lines[0]} "
                "(the form is key=value, +key=value to add a key, group=option)"
            ) from None


def chosen_budgets(overrides: Sequence[str]) -> dict[str, str]:
    """The trainer budgets the command line names, with their values (null included)."""
    named = {}
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if key.startswith("trainer.") and key.removeprefix("trainer.") in BUDGET_KEYS:
            named[key.removeprefix("trainer.")] = value.strip()
    return named


def other_budgets_cleared(overrides: Sequence[str]) -> list[str]:
    """The `trainer.KEY=null` overrides that let one budget named on the command line
    replace the trainer preset's own.

    `trainer.max_steps=100` means "train 100 steps"; kept beside the preset's budget
    (cpu: budget_tokens, gpu: tokens_per_param) it would make two, which a run refuses.
    Budgets that the command line names itself, two of them, or one set to null, are left
    as written: that choice is the user's, and two are still refused.
    """
    named = chosen_budgets(overrides)
    chosen = [key for key, value in named.items() if value.lower() not in ("null", "")]
    if len(chosen) != 1:
        return []
    return [f"trainer.{key}=null" for key in BUDGET_KEYS if key not in named]


def first_failing(overrides: Sequence[str]) -> str | None:
    """The first override whose prefix of the command line no longer composes."""
    for end in range(1, len(overrides) + 1):
        try:
            _hydra_compose(overrides[:end])
        except Exception:  # any failure: this is the override that breaks it
            return overrides[end - 1]
    return None


def unknown_key_message(error: BaseException, overrides: Sequence[str]) -> str | None:
    """For an override of a key the config does not have: which level lacks the key, the
    closest key there, and the keys it has. None for every other error.

    Hydra says "Could not override 'k'." on one line and the reason (OmegaConf's "Key 'x'
    is not in struct") on others; the one line users get must carry the fix: a typo's
    right spelling, or the + that adds a key where sweep files take new ones."""
    from omegaconf import OmegaConf

    named = re.match(r"Could not override '([^']+)'", str(error))
    cause = error.__cause__
    if not named or cause is None or "not in struct" not in str(cause):
        return None
    key = named.group(1)
    # OmegaConf's full_key writes list items as [0]; overrides write them as .0
    missing_path = re.sub(r"\[(\d+)\]", r".\1", getattr(cause, "full_key", "") or "")
    parent_path, _, missing = missing_path.rpartition(".")
    if not missing:
        return None
    if missing == "sweep" and not parent_path:
        return f"{key}: no sweep is selected; choose one first with +sweep=NAME (e.g. +sweep=lr_bs)"
    # an override that merges a mapping into a key that exists lacks a key below it
    adds_the_key = key == missing_path or key.startswith(missing_path + ".")
    message = f"unknown config key: {key if adds_the_key else missing_path}"
    rest = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] != key]
    schema = sweep_schema_keys(parent_path)
    try:  # the config without the bad override, to read the level that lacks the key
        parent = compose(rest)
        if parent_path:
            parent = OmegaConf.select(parent, parent_path)
        siblings = [str(k) for k in parent]
    except Exception:  # other overrides fail as well: say what is known
        return f"{message} ({parent_path or 'the config'} has no '{missing}')"
    # a sweep file sets only some of a level's keys: name every one a + may add
    siblings += [k for k in schema or () if k not in siblings]
    # a key the schema has that this sweep file does not set is not a typo: it takes a +
    unset = schema is not None and missing in schema
    value = next((o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == key), "...")
    if unset and adds_the_key:
        return f"{key} is not set in this sweep's file: to add it, write +{key}={value}"
    close = (
        []
        if unset
        else difflib.get_close_matches(missing, [k for k in siblings if k != missing], n=1)
    )
    if close:
        message += f": did you mean {'.'.join(filter(None, [parent_path, close[0]]))}?"
    shown = ", ".join(siblings[:12]) + (", ..." if len(siblings) > 12 else "")
    message += f" ({parent_path or 'the config'} has {shown})"
    if re.fullmatch(r"sweep\.stages\.\d+\.params\..+", parent_path) and missing in KINDS:
        # a searched param's kind (log_uniform -> grid) is a key of its own: replacing it
        # takes the old one removed and the new one added
        old = siblings[0] if siblings else "KIND"
        return (
            f"{message}; to change its kind, write '~{parent_path}.{old}' "
            f"'+{parent_path}.{missing}=...'"
        )
    # a sweep's levels take their schema's other keys (points, extend_trials), and a
    # stage's params any key to search, with a +; not a typo's fix
    addable = schema is None or missing in schema
    if key.startswith("sweep.") and adds_the_key and not close and addable:
        message += f"; to add it, write +{key}={value}"
    return message


def sweep_schema_keys(path: str) -> list[str] | None:
    """The keys the sweep schema allows at `path` (sweep, sweep.budget, sweep.bohb,
    sweep.stages.N); None where any key goes (a stage's params) or outside sweep."""
    schemas = {"sweep": SweepSpec, "sweep.budget": BudgetSpec, "sweep.bohb": BohbSpec}
    schema = schemas.get(path) or (StageSpec if re.fullmatch(r"sweep\.stages\.\d+", path) else None)
    return [f.name for f in fields(schema)] if schema else None
