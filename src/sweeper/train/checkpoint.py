"""Training-state files that survive a kill at any moment.

A save writes a temporary file in the same directory, fsyncs it and renames it over the
target (atomic on POSIX): a kill mid-save leaves the previous file whole. A load that
finds the newest checkpoint unreadable falls back to the previous one.
"""

from __future__ import annotations

from pathlib import Path

from sweeper.files import write_atomic

STATE_FILE = "training_state.pt"


def save_state(folder: str | Path, state: dict, name: str = STATE_FILE) -> Path:
    import torch

    return write_atomic(Path(folder) / name, lambda f: torch.save(state, f))


def load_state(folder: str | Path, name: str = STATE_FILE) -> dict:
    """The saved state, every tensor on the CPU: train() copies it to the run's device.
    Loaded where it was saved instead, every rank of a DDP resume would put rank 0's whole
    state on cuda:0, and a GPU run's checkpoint would not load on a CPU machine."""
    import torch

    return torch.load(Path(folder) / name, map_location="cpu", weights_only=True)


def load_latest_state(checkpoint_dir: str | Path) -> dict | None:
    """The state in `checkpoint_dir`, or, if that one is corrupt, in the newest readable
    sibling checkpoint (Ray Tune names them checkpoint_000NNN in the trial's folder)."""
    checkpoint_dir = Path(checkpoint_dir)
    candidates = [checkpoint_dir] + sorted(
        (p for p in checkpoint_dir.parent.glob("checkpoint_*") if p != checkpoint_dir),
        reverse=True,
    )
    for folder in candidates:
        try:
            return load_state(folder)
        except Exception as error:  # truncated or corrupt: try the previous checkpoint
            print(f"checkpoint {folder} is unreadable ({type(error).__name__}): trying older")
    return None
