"""Where the config tree lives: the checkout's conf/ (sweeps/ linked in as conf/sweep),
or the copy an installed wheel carries inside the package."""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # src/sweeper, or the installed package


def config_dir() -> Path:
    installed = PACKAGE_DIR / "_configs" / "conf"
    if (installed / "config.yaml").is_file():
        return installed
    checkout = PACKAGE_DIR.parents[1] / "conf"  # src/sweeper -> repository root
    if (checkout / "config.yaml").is_file():
        return checkout
    raise FileNotFoundError(f"sweeper's config tree is missing (looked in {installed}, {checkout})")
