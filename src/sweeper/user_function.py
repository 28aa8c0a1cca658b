"""A user's own function as the trainable (`trainable._target_=pkg.module.fn`): found,
imported and checked before anything runs, and the config it is given."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from sweeper.config.errors import ConfigError
from sweeper.config.schema import BUILTIN_TRAINABLE, NONEMPTY_DIR_KEY

# the keys that configure the platform, not a run: a user's function is not given them
PLATFORM_KEYS = ("sweep", "ray", "mlflow", "trainable", "hydra", "fit", NONEMPTY_DIR_KEY)


def trainable_target(cfg) -> str | None:
    """The user's function ("pkg.module.fn"), or None for sweeper's own training run."""
    target = cfg.get("trainable", {}).get("_target_", BUILTIN_TRAINABLE)
    if target is None or not str(target).strip():
        raise ConfigError(
            f"trainable._target_={target or ''}: name a function (pkg.module.fn), or leave "
            f"it at {BUILTIN_TRAINABLE} for sweeper's own training"
        )
    return None if target == BUILTIN_TRAINABLE else target


def load_target(target: str):
    module, _, name = target.rpartition(".")
    return getattr(importlib.import_module(module), name)


def load_user_function(target: str):
    """The user's function `target` names, checked: importable, of (config, report)."""
    if "." not in target.strip("."):
        raise ConfigError(
            f"trainable._target_={target}: name the function with its module, pkg.module.fn"
        )
    try:
        fn = load_target(target)
    except (ImportError, AttributeError, ValueError) as error:
        raise ConfigError(f"trainable._target_={target} cannot be imported: {error}") from None
    except Exception as error:  # its module fails as it is imported: its own bug
        raise ConfigError(
            f"trainable._target_={target}: importing its module raised "
            f"{type(error).__name__}: {error}"
        ) from None
    check_signature(target, fn)
    return fn


def check_signature(target: str, fn: Any) -> None:
    """A user's trainable is called as fn(config, report): anything else would fail in
    every trial, after Ray started."""
    usage = f"trainable._target_={target} must be a function of (config, report)"
    if not callable(fn):
        raise ConfigError(f"{usage}; it is a {type(fn).__name__}")
    if inspect.isclass(fn):  # calling it makes an object, which reports nothing
        raise ConfigError(f"{usage}; it is a class")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have none to read: let the trial say
        return
    try:
        signature.bind({}, print)
    except TypeError as error:
        raise ConfigError(f"{usage}; its signature is {signature} ({error})") from None


def user_function_config(cfg) -> dict:
    """What a user's function is given: the whole composed tree as plain values, less the
    platform's own sections (its own, `+mine.layers=3`, stay)."""
    from omegaconf import OmegaConf

    tree = OmegaConf.to_container(cfg, resolve=True)
    for key in PLATFORM_KEYS:
        tree.pop(key, None)
    return tree
