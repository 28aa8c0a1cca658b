"""Turning rows (dicts from a CSV or a sweep) into the numeric arrays the fits use.

A record is a dict with any of the keys N (parameters), D (tokens), C (FLOPs), loss, budget
(IsoFLOP budget label), lr, batch_size, final, seed. Missing quantities are completed from
C = 6 N D where two of the three are known. Runs that differ only in their seed are one
measurement: `average_seeds` replaces them by their mean.
"""

from __future__ import annotations

import csv
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

FIELDS = ("N", "D", "C", "loss", "budget", "lr", "batch_size", "final", "seed")

# Auto-detection: header names are lower-cased and runs of space/_/-/. become one space, then
# compared with these spellings in order (the first match wins).
COLUMN_ALIASES: dict[str, tuple[str, ...]] = {
    "N": (
        "n",
        "params",
        "parameters",
        "model size",
        "model params",
        "num params",
        "n params",
        "nparams",
        "param count",
        "num parameters",
        "non embedding params",
    ),
    "D": (
        "d",
        "tokens",
        "training tokens",
        "num tokens",
        "n tokens",
        "train tokens",
        "dataset size",
    ),
    "C": (
        "c",
        "flops",
        "training flop",
        "training flops",
        "compute",
        "flop",
        "total flops",
        "train flops",
    ),
    "loss": (
        "loss",
        "val loss",
        "val bpb",
        "validation loss",
        "eval loss",
        "valid loss",
        "bpb",
        "final loss",
        "test loss",
        "train loss",
    ),
    "budget": (
        "budget",
        "flops budget",
        "flop budget",
        "compute budget",
        "budget flops",
        "isoflop",
        "isoflop budget",
    ),
    "lr": ("lr", "learning rate", "learning_rate", "peak lr", "max lr"),
    "batch_size": ("batch size", "total batch size", "bs", "global batch size"),
    "final": ("final", "is final"),
    "seed": ("seed", "random seed", "trainer seed", "run seed"),
}

# Columns of a finished sweep's reports.csv (written by the sweep engine).
SWEEP_COLUMNS = {
    "N": "params",
    "D": "tokens",
    "C": "flops",
    "loss": "val_bpb",
    "budget": "budget",
    "lr": "peak_lr",  # the run's peak LR; `lr` is the schedule's LR at each report
    "batch_size": "total_batch_size",
    "final": "final",
    "seed": "seed",
}

_TRUE = {"1", "true", "yes", "y", "t"}
_FALSE = {"0", "false", "no", "n", "f"}


class InputError(ValueError):
    """Bad input data; the CLI turns it into a one-line message and exit code 2."""


def _norm(name: str) -> str:
    return re.sub(r"[\s_\-.]+", " ", name.strip().lower()).strip()


def detect_columns(
    header: list[str],
    explicit: dict[str, str | None] | None = None,
    preferred: dict[str, str] | None = None,
) -> dict:
    """Map record fields to CSV column names.

    explicit names (from --n-col etc.) must exist; preferred names are used when present;
    otherwise the first alias found in the header is taken.
    """
    by_norm = {}
    for col in header:
        by_norm.setdefault(_norm(col), col)
    mapping: dict[str, str] = {}
    for fld in FIELDS:
        want = (explicit or {}).get(fld)
        if want:
            if _norm(want) not in by_norm:
                raise InputError(f"column {want!r} not found (columns: {', '.join(header)})")
            mapping[fld] = by_norm[_norm(want)]
            continue
        pref = (preferred or {}).get(fld)
        if pref and _norm(pref) in by_norm:
            mapping[fld] = by_norm[_norm(pref)]
            continue
        for alias in COLUMN_ALIASES[fld]:
            if alias in by_norm and by_norm[alias] not in mapping.values():
                mapping[fld] = by_norm[alias]
                break
    return mapping


def _to_float(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


def _to_bool(value):
    if isinstance(value, bool) or value is None:
        return value
    s = str(value).strip().lower()
    if s in _TRUE:
        return True
    if s in _FALSE:
        return False
    return None


def column_list(header: list[str], most: int = 12) -> str:
    """A header for a one-line message: the first `most` names, quoted where a name is
    empty or unprintable (a binary file read as CSV)."""
    names = [n.strip() if n.strip().isprintable() and n.strip() else repr(n) for n in header[:most]]
    more = f", ... ({len(header)} in all)" if len(header) > most else ""
    return ", ".join(names) + more


def read_csv_records(
    path: Path,
    explicit: dict[str, str | None] | None = None,
    preferred: dict[str, str] | None = None,
    return_columns: bool = False,
):
    """Read a CSV into records, detecting columns. Raises InputError for unusable files.

    With return_columns, returns (records, {field: column name}).
    """
    try:
        with open(path, newline="") as fh:
            rows = list(csv.reader(fh))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise InputError(f"cannot read {path}: {exc}") from None
    if not rows or not any(cell.strip() for cell in rows[0]):
        raise InputError(f"{path} is empty or has no header row")
    header = rows[0]
    # (line in the file, row) of the rows that hold anything: the line names a bad cell
    body = [(line, r) for line, r in enumerate(rows[1:], start=2) if any(c.strip() for c in r)]
    mapping = detect_columns(header, explicit, preferred)
    if "loss" not in mapping:
        raise InputError(
            f"no loss column in {path} (columns: {column_list(header)}); use --loss-col"
        )
    if not {"C", "N"} & mapping.keys():
        raise InputError(f"{path} has neither a compute nor a parameter-count column")
    if body and len(body[-1][1]) < len(header):  # a writer stopped mid-row: the file is partial
        line, last = body[-1]
        raise InputError(
            f"{path} line {line} is cut short ({len(last)} of {len(header)} columns): the file "
            "was not written whole; fit it once its writer has finished"
        )
    pos = {fld: header.index(col) for fld, col in mapping.items()}
    records = []
    for line, row in body:
        rec = {}
        for fld, i in pos.items():
            cell = row[i].strip() if i < len(row) else ""
            if fld == "final":
                rec[fld] = _to_bool(cell)
            elif fld == "budget":
                rec[fld] = cell or None
            else:
                rec[fld] = _to_float(cell)
                if cell and math.isnan(rec[fld]) and cell.lower() != "nan":
                    # read as NaN, the row left the fits with no word (an empty cell is an
                    # unknown value; 'nan' a measured one, dropped with a warning)
                    raise InputError(
                        f"{path} line {line}: column {header[i]!r} holds {cell!r}, not a number"
                    )
        records.append(rec)
    return (records, mapping) if return_columns else records


@dataclass
class Points:
    """Columns of the usable records (loss finite and > 0), NaN where a value is unknown."""

    N: np.ndarray
    D: np.ndarray
    C: np.ndarray
    loss: np.ndarray
    lr: np.ndarray
    batch_size: np.ndarray
    budget: list
    final: np.ndarray
    n_records: int
    n_dropped: int
    seed: np.ndarray | None = None  # NaN where unknown; None: no record has one
    # usable losses whose N, D or C is zero or negative: the fits that read it leave them out
    n_nonpositive_size: int = 0
    by_seed: list[dict] | None = None  # each averaged point's loss on each seed: {seed: loss}

    def take(self, idx: np.ndarray) -> Points:
        """The points at indices `idx` (their seeds' losses too, where averaged)."""
        return Points(
            N=self.N[idx],
            D=self.D[idx],
            C=self.C[idx],
            loss=self.loss[idx],
            lr=self.lr[idx],
            batch_size=self.batch_size[idx],
            budget=[self.budget[i] for i in idx],
            final=self.final[idx],
            n_records=self.n_records,
            n_dropped=self.n_dropped,
            seed=None if self.seed is None else self.seed[idx],
            by_seed=None if self.by_seed is None else [self.by_seed[i] for i in idx],
        )

    def has(self, name: str) -> np.ndarray:
        """Mask of points where the numeric column is finite and positive."""
        v = getattr(self, name)
        with np.errstate(invalid="ignore"):
            return np.isfinite(v) & (v > 0)


def _budget_label(value):
    """A hashable label: a float when numeric, else a stripped string; None when absent."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float, np.number)):
        return None
    if isinstance(value, (int, float, np.number)) and not np.isfinite(value):
        return None
    if isinstance(value, str):
        value = value.strip()
        if not value or value.lower() in {"nan", "none", "null"}:
            return None
        num = _to_float(value)
        return num if np.isfinite(num) else value
    return value


def to_points(records: list[dict]) -> Points:
    """Columns from records; completes C = 6ND / D = C/(6N) and drops unusable losses."""
    keys = ("N", "D", "C", "loss", "lr", "batch_size", "seed")
    col = {k: np.array([_to_float(r.get(k)) for r in records]) for k in keys}
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        n, d, c = col["N"], col["D"], col["C"]
        c = np.where(np.isfinite(c), c, 6.0 * n * d)
        d = np.where(np.isfinite(d), d, c / (6.0 * n))
        n = np.where(np.isfinite(n), n, c / (6.0 * d))
        ok = np.isfinite(col["loss"]) & (col["loss"] > 0)
    final = np.array([_to_bool(r.get("final")) is not False for r in records], dtype=bool)
    budget = [_budget_label(r.get("budget")) for r in records]
    keep = np.flatnonzero(ok)
    nonpositive = np.zeros(len(records), dtype=bool)
    for values in (n, d, c):
        nonpositive |= np.isfinite(values) & (values <= 0)
    return Points(
        N=n[keep],
        D=d[keep],
        C=c[keep],
        loss=col["loss"][keep],
        lr=col["lr"][keep],
        batch_size=col["batch_size"][keep],
        budget=[budget[i] for i in keep],
        final=final[keep],
        n_records=len(records),
        n_dropped=len(records) - len(keep),
        seed=col["seed"][keep],
        n_nonpositive_size=int((nonpositive & ok).sum()),
    )


def average_seeds(pts: Points) -> tuple[Points, dict | None]:
    """One point per measurement: points equal in every field but the seed and the loss (the
    same N, D, C, budget, LR, batch size, at the same report) become one point at their mean
    loss. A grid point's lowest loss over seeds is its luckiest draw, which is what the
    optima and the envelope would otherwise pick. Where one seed holds several such points
    (they differ in something the records do not carry, such as the weight decay) the
    seed's lowest is taken first, as the fits do without seeds.

    Returns the averaged points and, when at least two seeds were averaged anywhere, what
    happened: the seeds, how many runs became how many points, and the pooled standard
    deviation of a final loss between seeds (the noise each optimum is read against)."""
    if pts.seed is None or len(set(pts.seed[np.isfinite(pts.seed)])) < 2:
        return pts, None
    groups: dict[tuple, dict[float, int]] = {}  # measurement -> seed -> index of its lowest
    alone = []
    for i in range(len(pts.loss)):
        if not np.isfinite(pts.seed[i]):
            alone.append(i)
            continue
        key = (
            *(
                None if not np.isfinite(v) else float(v)
                for v in (pts.N[i], pts.D[i], pts.C[i], pts.lr[i], pts.batch_size[i])
            ),
            pts.budget[i],
            bool(pts.final[i]),
        )
        per_seed = groups.setdefault(key, {})
        s = float(pts.seed[i])
        if s not in per_seed or pts.loss[i] < pts.loss[per_seed[s]]:
            per_seed[s] = i
    first, loss, by_seed, spread = [], [], [], []
    for per_seed in groups.values():
        idx = sorted(per_seed.values())
        first.append(idx[0])
        values = pts.loss[idx]
        loss.append(float(values.mean()))
        by_seed.append({s: float(pts.loss[i]) for s, i in per_seed.items()})
        if len(idx) > 1 and pts.final[idx[0]]:
            spread.append((len(idx) - 1, float(values.var(ddof=1))))
    keep = np.array(first + alone, dtype=int)
    order = np.argsort(keep, kind="stable")  # the records' order, as before
    keep = keep[order]
    averaged = replace(
        pts.take(keep),
        loss=np.array(loss + [float(pts.loss[i]) for i in alone])[order],
        seed=np.full(len(keep), np.nan),
        by_seed=[by_seed[i] if i < len(by_seed) else {} for i in order],  # alone: {}
    )
    if not spread:
        return averaged, None
    dof = sum(d for d, _ in spread)
    final_runs = int(np.sum(pts.final & np.isfinite(pts.seed)))
    info = {
        "seeds": sorted(
            {int(s) if s.is_integer() else s for s in map(float, pts.seed) if np.isfinite(s)}
        ),
        "final_runs": final_runs,
        "final_points": sum(1 for key in groups if key[-1]),  # key[-1]: final
        "points_with_repeats": len(spread),
        "sd": float(np.sqrt(sum(d * v for d, v in spread) / dof)),
    }
    return averaged, info
