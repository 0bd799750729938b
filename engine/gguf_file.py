"""Opening a GGUF file: its metadata as plain Python values, and its tensors, with clear errors."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from engine.errors import ModelFormatError, ModelNotFound


@dataclass
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    reader: gguf.GGUFReader

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise ModelFormatError(f"{self.path.name}: GGUF metadata lacks {key!r}")
        return self.metadata[key]


def open_gguf(path: Path) -> GGUFFile:
    if not path.is_file():
        raise ModelNotFound(f"no such GGUF file: {path}")
    try:
        reader = gguf.GGUFReader(path, "r")
    except (ValueError, OSError, IndexError, KeyError) as err:
        raise ModelFormatError(f"{path.name} is not a readable GGUF file: {err}") from err
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            value = field.contents()
        except (ValueError, IndexError, UnicodeDecodeError) as err:
            raise ModelFormatError(f"{path.name}: GGUF field {key!r} is corrupt: {err}") from err
        metadata[key] = value.item() if isinstance(value, np.generic) else value
    return GGUFFile(path=path, metadata=metadata, reader=reader)
