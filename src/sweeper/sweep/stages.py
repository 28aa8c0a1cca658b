"""Pure helpers of the staged sweep: apply sampled values, follow the batch size with the
LRs, pick a stage's best trial, freeze it into the next stage's base config, and write
values back as Hydra overrides."""

from __future__ import annotations

import copy
import math
import shlex
from typing import Any

from sweeper.config.schema import BUDGET_KEYS, RunConfig, load_run_config, micro_batch_dividing
from sweeper.config.sweep import flatten
from sweeper.seeds import paired_lead
from sweeper.text import hydra_value

BATCH_KEY = "trainer.total_batch_size"
SEED_KEY = "trainer.seed"


def set_dotted(tree: dict, key: str, value: Any) -> None:
    node = tree
    *parents, leaf = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def get_dotted(tree: dict, key: str, default: Any = None) -> Any:
    node = tree
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def apply_params(base: dict, params: dict[str, Any]) -> dict:
    """A copy of the nested `base` config with dotted `params` written in."""
    tree = copy.deepcopy(base)
    for key, value in params.items():
        set_dotted(tree, key, value)
    return tree


def fit_micro_batch(config: dict) -> dict:
    """`config` with its micro-batch (trainer.device_batch_size, in sequences) lowered to
    the largest that divides its batch (lr_bs: 16 x 256 tokens divide no batch below 4096).
    Gradient accumulation makes the same update from smaller pieces, so in a sweep the
    micro-batch is a ceiling (what fits in memory), not a bound on the batches a stage tries.
    Unchanged where none divides (the run's check says why); a plain run refuses such a batch."""
    trainer, model = config.get("trainer"), config.get("model")
    try:
        total, device_batch = int(trainer["total_batch_size"]), int(trainer["device_batch_size"])
        sequence_tokens = int(model["seq_len"]) * int(trainer.get("workers", 1))
    except (KeyError, TypeError, ValueError):
        return config  # not sweeper's run config, or a bad value its check names
    if sequence_tokens <= 0 or device_batch <= 0 or total % (device_batch * sequence_tokens) == 0:
        return config
    fitted = micro_batch_dividing(total, sequence_tokens, device_batch)
    if fitted is None:
        return config
    return {**config, "trainer": {**trainer, "device_batch_size": fitted}}


def sweep_run(base: dict, params: dict[str, Any]) -> dict:
    """The run a sweep makes of `base` with `params` written in: its micro-batch fitted to
    its batch (fit_micro_batch), as every trial's is (trainable.placed)."""
    return fit_micro_batch(apply_params(base, params))


def fitted_micro_batches(params, base: dict) -> str | None:
    """What a stage's first line says of the listed batch sizes (`params`, its ParamSpecs)
    that train in a smaller micro-batch than `base`'s (fit_micro_batch): 'batch 2048 in
    micro-batches of 8 sequences (trainer.device_batch_size=16 does not divide it)'. None
    where there are none."""
    batch = next((p for p in params if p.name == BATCH_KEY and p.values), None)
    own = get_dotted(base, "trainer.device_batch_size")
    if batch is None or own is None:
        return None
    fitted = []
    for value in batch.values:
        run = sweep_run(base, {BATCH_KEY: value})
        if (micro := get_dotted(run, "trainer.device_batch_size")) != own:
            fitted.append((value, micro))
    if not fitted:
        return None
    shown = ", ".join(f"{value} in micro-batches of {micro}" for value, micro in fitted)
    them = "it" if len(fitted) == 1 else "them"
    return f"batch {shown} sequences (trainer.device_batch_size={own} does not divide {them})"


def lr_scale(rule: str, batch: float, base_batch: float) -> float:
    """Factor on the frozen LRs when the batch goes from base_batch to batch tokens:
    sqrt (Adam-style noise scale, Malladi et al. 2022) or linear (Goyal et al. 2017)."""
    if rule == "sqrt":
        return math.sqrt(batch / base_batch)
    if rule == "linear":
        return batch / base_batch
    return 1.0


def follow_batch_size(
    config: dict, rule: str, base_batch: float, lr_keys: list[str], sampled: set[str]
) -> dict:
    """Rescale the frozen LRs of `config` for its batch size. LRs the stage samples itself
    are left alone (they are being tuned at this batch size)."""
    batch = get_dotted(config, BATCH_KEY)
    factor = lr_scale(rule, batch, base_batch) if batch else 1.0
    if factor == 1.0:
        return config
    config = copy.deepcopy(config)
    for key in lr_keys:
        value = get_dotted(config, key)
        if key not in sampled and isinstance(value, int | float):
            set_dotted(config, key, value * factor)
    return config


def ranking_pool(trials: list[dict]) -> list[dict]:
    """The trials a stage's best is picked from: those whose metric says how good their
    configuration is (not a diverged trial's penalty, not a failed trial's), and of these
    the ones that ran their whole budget when any did (a pruned trial's last value is at
    fewer tokens, not comparable)."""
    usable = [
        t
        for t in trials
        if finite_number(t.get("metric")) and t.get("status") not in ("diverged", "failed")
    ]
    return [t for t in usable if t.get("status") == "completed"] or usable


def without_seed(params: dict) -> dict:
    return {k: v for k, v in params.items() if k != SEED_KEY}


def mean_metric(group: list[dict]) -> float:
    return sum(t["metric"] for t in group) / len(group)


def pick_best(trials: list[dict], metric: str, mode: str) -> dict | None:
    """The best trial of `ranking_pool`, by `metric`."""
    pool = ranking_pool(trials)
    if not pool:
        return None
    sign = 1 if mode == "min" else -1
    repeats = seed_repeats(pool)
    if repeats is None:
        return min(pool, key=lambda t: sign * t["metric"])
    # a configuration run on several seeds (a grid with trainer.seed as an axis) ranks by
    # its mean: its best single seed is a lucky draw. One that lost a seed (diverged,
    # failed) ranks after those that finished on every seed.
    most = max(len(group) for group in repeats)
    group = min(repeats, key=lambda g: (len(g) < most, sign * mean_metric(g)))
    first = min(group, key=lambda t: sign * t["metric"])
    best = {
        **first,
        "params": without_seed(first["params"]),
        "metric": mean_metric(group),
        "seeds": sorted(t["params"][SEED_KEY] for t in group),
        "trial_ids": [t["trial_id"] for t in group],
    }
    if "round_params" in first:
        best["round_params"] = without_seed(first["round_params"])
    return best


def keeps_its_start(incumbent: dict | None, best: dict | None, mode: str) -> bool:
    """Whether the config a stage started from beats the stage's own best, so that the
    stage must freeze nothing. `incumbent`: the trial, in an earlier stage, that config
    came from. A stage whose grid leaves out the value it started from (a batch-size grid
    without the frozen batch) must not trade a better config for a worse one. The two
    values compare only where both trials trained the whole of the sweep's one budget on
    one seed: not where a stage searched the budget or the seed itself."""
    if incumbent is None or best is None:
        return False
    for trial in (incumbent, best):
        searched = set(trial["params"]) | ({SEED_KEY} if "seeds" in trial else set())
        if trial.get("status") != "completed" or searched & UNCOMPARABLE_KEYS:
            return False
    sign = 1 if mode == "min" else -1
    return sign * incumbent["metric"] < sign * best["metric"]


# a stage that searches one of these has trials that train other budgets (or seeds) than
# the sweep's one: its values do not compare with another stage's
UNCOMPARABLE_KEYS = frozenset({SEED_KEY, *(f"trainer.{key}" for key in BUDGET_KEYS)})


def unresolved_rivals(trials: list[dict], best: dict | None, mode: str) -> list[dict]:
    """Where the stage's best is a mean over seeds (`pick_best`): the configurations it
    does not clearly beat on the seeds both ran (`seeds.paired_lead`), closest first. Each
    is {"params": what differs from the best, "mean": its mean, "note": the lead in words}.
    A stage whose seeds cannot tell its best from another value froze one of several
    equally good values."""
    if not best or "seeds" not in best:
        return []
    pool = ranking_pool(trials)
    sign = 1 if mode == "min" else -1
    ids = set(best["trial_ids"])
    mine = {t["params"][SEED_KEY]: t["metric"] for t in pool if t["trial_id"] in ids}
    rivals = []
    for group in seed_repeats(pool) or []:
        if ids & {t["trial_id"] for t in group}:
            continue
        lead = paired_lead(mine, {t["params"][SEED_KEY]: t["metric"] for t in group}, sign)
        if lead is None or lead.resolved:
            continue
        params = {
            k: v for k, v in without_seed(group[0]["params"]).items() if best["params"].get(k) != v
        }
        rivals.append({"params": params, "mean": mean_metric(group), "note": lead.short()})
    return sorted(rivals, key=lambda r: sign * r["mean"])


def seed_repeats(trials: list[dict]) -> list[list[dict]] | None:
    """The trials grouped by configuration, where trainer.seed is sampled and some
    configuration ran on more than one seed; None otherwise."""
    if not trials or any(SEED_KEY not in t.get("params", {}) for t in trials):
        return None
    groups: dict[str, list[dict]] = {}
    for t in trials:
        rest = sorted((k, repr(v)) for k, v in t["params"].items() if k != SEED_KEY)
        groups.setdefault(repr(rest), []).append(t)
    if all(len(group) == 1 for group in groups.values()):
        return None
    return list(groups.values())


def finite_number(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def reproduce_command(overrides: list[str]) -> str:
    """The shell line that runs the best config again. Quoted where a shell would read an
    override otherwise: a shard glob (zsh refuses an unmatched one), a path with spaces."""
    return shlex.join(["python", "-m", "sweeper", *overrides])


def reproduce_overrides(final: dict) -> list[str]:
    """Hydra overrides that turn `python -m sweeper`'s default run into `final`: both sides
    resolved through the schema, so derived values (vocab size) do not show up as changes."""
    before = flatten(RunConfig().to_dict())
    after = flatten(load_run_config(final).to_dict())
    return [f"{k}={hydra_value(after[k])}" for k in sorted(after) if before.get(k) != after[k]]
