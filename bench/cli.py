"""What the benchmarks' command lines share: where their JSON goes, where model files are."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any


def json_option(parser: argparse.ArgumentParser, filename: str) -> None:
    """--json PATH, by default `filename` under $OUT (the device machine's output folder) or
    bench/."""
    parser.add_argument(
        "--json",
        type=Path,
        default=Path(os.environ.get("OUT", "bench")) / filename,
        help=f"where the numbers go (default: $OUT or bench/, {filename})",
    )


def write_json(path: Path, data: Any) -> None:
    """The numbers of a run at `path` (its folder made where missing), and a line saying so."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
    print(f"wrote {path}")


def first_paragraph(doc: str | None) -> str:
    """A module docstring's first paragraph, for `--help`: its first line alone stops
    mid-sentence where the paragraph wraps."""
    return " ".join((doc or "").strip().split("\n\n")[0].split())


def tandem_home() -> Path:
    """Where model files are cached: $TANDEM_HOME, else ~/.cache/tandem (as the CLI has it)."""
    return Path(os.environ.get("TANDEM_HOME", "~/.cache/tandem")).expanduser()
