"""Reading a Hugging Face safetensors checkpoint folder (LLaMA naming, one or many shards)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from engine.errors import ModelFormatError, ModelNotFound


class SafetensorsWeights:
    def __init__(self, folder: Path) -> None:
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ModelNotFound(f"{folder} holds no *.safetensors files")
        self.folder = folder
        self._open: dict[Path, Any] = {}
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.location = {name: folder / file for name, file in weight_map.items()}
        else:
            self.location = {n: f for f in files for n in self._handle(f).keys()}  # noqa: SIM118

    def _handle(self, file: Path) -> Any:
        if file not in self._open:
            try:
                self._open[file] = safe_open(str(file), framework="pt")
            except (SafetensorError, OSError) as err:
                raise ModelFormatError(
                    f"{file.name} is not a readable safetensors file: {err}"
                ) from err
        return self._open[file]

    def has(self, name: str) -> bool:
        return name in self.location

    def numel(self, name: str) -> int:
        return math.prod(self._handle(self.location[name]).get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        if name not in self.location:
            raise ModelFormatError(f"{self.folder.name}: checkpoint has no tensor {name}")
        return self._handle(self.location[name]).get_tensor(name)


def read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise ModelNotFound(f"{folder} has no config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ModelFormatError(f"{path} is not valid JSON: {err}") from err
