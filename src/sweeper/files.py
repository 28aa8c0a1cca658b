"""Output files written whole or not at all.

Every file a run or a sweep leaves (result.json, summary.json, reports.csv, fit.json,
report.md/.html, the plots, the sweep's state, checkpoints) goes through `write_atomic`: a
temporary file beside the target, fsync, rename over the target, fsync of the directory. A
kill at any moment leaves the old file or the new one, never half of one; what a kill leaves
of the temporary file is removed by the next run in that directory (`remove_stale_temps`).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

TEMP_PREFIX = ".partial-"  # a temporary file's name: TEMP_PREFIX + target's name + suffix


def write_atomic(path: str | Path, write: Callable[[IO[bytes]], Any]) -> Path:
    """`write(f)` into a temporary file in `path`'s directory, then renamed over `path`."""
    path = Path(path)
    tmp = path.with_name(f"{TEMP_PREFIX}{path.name}.{os.getpid()}-{secrets.token_hex(4)}")
    # os.open with 0o666 keeps the umask's permissions (mkstemp's files are private)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)
    return path


def fsync_dir(folder: Path) -> None:
    """The rename itself made durable: without it a power cut can undo it."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: str | Path, text: str) -> Path:
    return write_atomic(path, lambda f: f.write(text.encode()))


def write_json_atomic(path: str | Path, payload: Any, **dumps: Any) -> Path:
    dumps = {"indent": 2, "default": str, **dumps}
    return write_text_atomic(path, json.dumps(payload, **dumps) + "\n")


def save_figure_atomic(fig, path: str | Path, **savefig: Any) -> Path:
    """A matplotlib figure saved whole; its format is the path's suffix."""
    fmt = Path(path).suffix.lstrip(".")
    return write_atomic(path, lambda f: fig.savefig(f, format=fmt, **savefig))


def remove_stale_temps(folder: str | Path) -> list[Path]:
    """The temporary files a killed writer left in `folder` and below (called by the process
    that holds the folder's lock, before it starts a writer of its own)."""
    removed = []
    for tmp in Path(folder).rglob(f"{TEMP_PREFIX}*"):
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
            removed.append(tmp)
    return removed
