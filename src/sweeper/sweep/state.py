"""What a sweep has finished, on disk, so `sweep.resume=true` skips it.

Written atomically (temporary file, fsync, os.replace) after every stage: a driver killed
at any moment leaves either the previous state or the new one, never half of one.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sweeper.config.errors import ConfigError
from sweeper.config.schema import RunConfig
from sweeper.config.sweep import flatten
from sweeper.files import write_json_atomic

STATE_NAME = "sweep_state.json"


@dataclass
class SweepState:
    out: Path
    name: str
    base: dict
    stages: list[dict] = field(default_factory=list)  # finished stages, in order
    baseline: dict | None = None
    # sweep.confirm_seeds' runs: {"overrides": the best's, "runs": {seed: {best, baseline}}}
    confirmation: dict | None = None
    elapsed: float = 0.0
    # what made the trials (sweep_definition); None in states written before it was kept
    definition: dict | None = None
    # the command line's overrides when the sweep started (a resume's are Hydra's record)
    launched: list[str] | None = None

    @classmethod
    def new(
        cls,
        out: Path,
        name: str,
        base: dict,
        definition: dict | None = None,
        launched: list[str] | None = None,
    ) -> SweepState:
        out.mkdir(parents=True, exist_ok=True)
        state = cls(out, name, base, definition=definition, launched=launched)
        state.save()
        return state

    @classmethod
    def load(cls, out: Path) -> SweepState | None:
        """The state in `out`, None where there is none; a file that is no sweep state
        sweeper wrote (cut short by a full disk, edited by hand) is a ConfigError."""
        path = out / STATE_NAME
        if not path.exists():
            return None
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict):
                raise ValueError(f"a JSON {type(data).__name__}, not an object")
            return cls(out=out, **data)
        except (OSError, ValueError, TypeError) as error:
            reason = " ".join(str(error).split()) or type(error).__name__
            raise ConfigError(
                f"{path} is not a sweep state sweeper can read ({reason}); it cannot be "
                "resumed: start the sweep again in another hydra.run.dir"
            ) from None

    def save(self) -> None:
        payload = {k: v for k, v in asdict(self).items() if k != "out"}
        write_json_atomic(self.out / STATE_NAME, payload)

    def stage_done(self, name: str) -> bool:
        return any(s["name"] == name for s in self.stages)

    def base_after_finished_stages(self) -> dict | None:
        return self.stages[-1]["base_after"] if self.stages else None

    def carried(self) -> dict | None:
        """The trial the config after the finished stages came from: the last stage's best,
        or an earlier stage's where the last stage kept the config it started from."""
        if not self.stages:
            return None
        return self.stages[-1].get("carried", self.stages[-1]["best"])

    def finish_stage(
        self,
        name,
        records,
        reports,
        best,
        base_after,
        elapsed,
        extended=None,
        carried=None,
        capped=False,
    ) -> None:
        self.stages.append(
            {
                "name": name,
                "records": records,
                "reports": reports,
                "best": best,
                "base_after": base_after,
                "carried": carried,
                # ranges an extend_trials round searched past the stage's own: {param: [lo, hi]}
                **({"extended": extended} if extended else {}),
                # sweep.max_seconds ran out during it: a resume with more time reopens it
                **({"capped": True} if capped else {}),
            }
        )
        self.elapsed = elapsed
        self.save()

    def reopens_capped_stage(self, max_seconds: float | None) -> bool:
        """Whether the last stage is one the time cap ran out in, and a run with
        `max_seconds` (a higher cap, or none) has more time for it."""
        if not self.stages or not self.stages[-1].get("capped"):
            return False
        return max_seconds is None or self.elapsed < max_seconds

    def reopen_last_stage(self) -> None:
        """Takes the last stage back out of the finished ones (a stage the time cap cut
        short, resumed with more time): its elapsed time stays counted."""
        self.stages.pop()
        self.save()

    def set_baseline(self, baseline: dict) -> None:
        self.baseline = baseline
        self.save()

    def set_confirmation(self, confirmation: dict) -> None:
        self.confirmation = confirmation
        self.save()

    def all_records(self) -> list[dict]:
        return [r for s in self.stages for r in s["records"]]

    def all_reports(self) -> list[dict]:
        return [r for s in self.stages for r in s["reports"]]

    def trial_count(self) -> int:
        return len(self.all_records())

    def total_flops(self) -> float:
        """Training FLOPs the sweep spent (`spent_flops` of all its trials)."""
        return spent_flops(self.all_records())


def spent_flops(records: list[dict]) -> float:
    """Training FLOPs trials spent: their runs and their rung cooldown forks; none for a
    trial that replayed an earlier run (its record names it `reused_from`)."""
    return sum(
        (r.get("flops") or 0.0) + (r.get("fork_flops") or 0.0)
        for r in records
        if not r.get("reused_from")
    )


# sweep keys a resumed sweep may change: they decide how many trials run, where and how
# fast, not what any trial computes (a cap raised to continue a sweep that hit it is the
# point of resuming)
OPERATIONAL_KEYS = frozenset(
    {
        "resume",
        "dry_run",
        "confirm_seeds",  # runs after the stages, on top of them: a finished sweep can add it
        "concurrency",
        "max_failures",
        "max_trials",
        "max_flops",
        "max_seconds",
        "cpus_per_trial",
        "gpus_per_trial",
    }
)


def sweep_definition(spec: Any) -> dict:
    """The sweep spec (a dataclass) as plain JSON values, without its operational keys."""
    return {k: v for k, v in as_json(asdict(spec)).items() if k not in OPERATIONAL_KEYS}


def as_json(tree: Any) -> Any:
    """`tree` as it reads back from sweep_state.json (tuples as lists, paths as strings)."""
    return json.loads(json.dumps(tree, default=str))


ABSENT = "(absent)"  # a key one of two trees lacks, as `differences` shows it


def differences(old: Any, new: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted path, old, new) for every leaf where two JSON-like trees differ."""
    if isinstance(old, dict) and isinstance(new, dict):
        keys = [*old, *(k for k in new if k not in old)]
        pairs = [(k, old.get(k, ABSENT), new.get(k, ABSENT)) for k in keys]
    elif isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        pairs = [(i, a, b) for i, (a, b) in enumerate(zip(old, new))]
    else:
        return [] if old == new else [(path, old, new)]
    return [d for k, a, b in pairs for d in differences(a, b, f"{path}.{k}" if path else str(k))]


def at_schema_default(key: str, value: Any) -> bool:
    """Whether `value` at dotted `key` (a leaf, or a whole new section) is what the run
    schema gives it by default."""
    defaults = flatten(as_json(RunConfig().to_dict()))
    leaves = flatten(value, f"{key}.") if isinstance(value, dict) else {key: value}
    return all(k in defaults and defaults[k] == v for k, v in leaves.items())


def check_resumable(state: SweepState, name: str, base: dict, definition: dict) -> None:
    """A run dir resumes only the sweep that wrote it: finished stages and trials are
    reused as they are, so a changed budget, space or model would otherwise be reported
    as if its trials had run. Raises ValueError naming the first differences."""
    if state.name != name:
        raise ValueError(f"run dir {state.out} holds sweep '{state.name}', not '{name}'")
    changed = [
        (f"sweep.{k}", a, b)
        for k, a, b in differences(state.definition, definition)
        # a key added to the sweep schema after the state was written, left at its default
        # (off: 0, null, []), or one removed from it that was off: nothing differs
        if not (a == ABSENT and not b) and not (b == ABSENT and not a)
    ]
    if state.definition is None:  # an older state file: only the run config is known
        changed = []
    # likewise a run config key added after the state was written, at the value the older
    # code behaved as (the schema's default: optimizer.weight_decay_schedule=constant)
    changed += [
        (k, a, b)
        for k, a, b in differences(as_json(state.base), as_json(base))
        if not (a == ABSENT and at_schema_default(k, b))
    ]
    if changed:
        raise ValueError(
            f"sweep.resume=true: run dir {state.out} holds a different sweep than this "
            f"command's: {changes_text(changed)}; resume with the overrides that started it, "
            "or give this sweep a new hydra.run.dir"
        )


def changes_text(changed: list[tuple[str, Any, Any]]) -> str:
    """The first three of `differences`' changes, as `key old -> new; ...`."""
    shown = "; ".join(f"{key} {a!r} -> {b!r}" for key, a, b in changed[:3])
    return shown + (f" (and {len(changed) - 3} more)" if len(changed) > 3 else "")
