"""What a sweep has finished, on disk, so `sweep.resume=true` skips it.

Written atomically (temporary file, fsync, os.replace) after every stage: a driver killed
at any moment leaves either the previous state or the new one, never half of one.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

STATE_NAME = "sweep_state.json"


def write_json_atomic(path: Path, payload: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@dataclass
class SweepState:
    out: Path
    name: str
    base: dict
    stages: list[dict] = field(default_factory=list)  # finished stages, in order
    baseline: dict | None = None
    elapsed: float = 0.0

    @classmethod
    def new(cls, out: Path, name: str, base: dict) -> SweepState:
        out.mkdir(parents=True, exist_ok=True)
        state = cls(out, name, base)
        state.save()
        return state

    @classmethod
    def load(cls, out: Path) -> SweepState | None:
        path = out / STATE_NAME
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
        return cls(out=out, **data)

    def save(self) -> None:
        payload = {k: v for k, v in asdict(self).items() if k != "out"}
        write_json_atomic(self.out / STATE_NAME, payload)

    def stage_done(self, name: str) -> bool:
        return any(s["name"] == name for s in self.stages)

    def base_after_finished_stages(self) -> dict | None:
        return self.stages[-1]["base_after"] if self.stages else None

    def finish_stage(self, name, records, reports, best, base_after, elapsed) -> None:
        self.stages.append(
            {
                "name": name,
                "records": records,
                "reports": reports,
                "best": best,
                "base_after": base_after,
            }
        )
        self.elapsed = elapsed
        self.save()

    def set_baseline(self, baseline: dict) -> None:
        self.baseline = baseline
        self.save()

    def all_records(self) -> list[dict]:
        return [r for s in self.stages for r in s["records"]]

    def all_reports(self) -> list[dict]:
        return [r for s in self.stages for r in s["reports"]]

    def trial_count(self) -> int:
        return len(self.all_records())

    def total_flops(self) -> float:
        return sum(r.get("flops") or 0.0 for r in self.all_records())
