"""Where the project's shared evaluation data lives (read in place, never copied into the repo)."""

import os
from pathlib import Path


def shared_dir() -> Path:
    """$QPALETTE_SHARED, else the ../shared folder beside the checkout."""
    return Path(os.environ.get("QPALETTE_SHARED") or Path(__file__).resolve().parents[2] / "shared")
