"""Random access to the samples of a split packed by vitpod.trainer.data.shards."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

INDEX = "index.json"
SAMPLES = "samples.npy"
FORMAT = "vitpod-shards-1"


class ShardReader:
    """Random access to a split's samples by index, one open file per shard and process."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.index = json.loads((self.folder / INDEX).read_text())
        if self.index.get("format") != FORMAT:
            raise ValueError(f"{self.folder / INDEX}: not a {FORMAT} index")
        self.table = np.load(self.folder / SAMPLES)
        self.names = [s["name"] for s in self.index["shards"]]
        self._files: dict[int, Any] = {}
        self._pid = os.getpid()
        self.opens = 0  # files opened by this process (the metadata cost the shards save)

    def __len__(self) -> int:
        return len(self.table)

    @property
    def labels(self) -> np.ndarray:
        return self.table[:, 3].copy()

    def path(self, index: int) -> str:
        return f"{self.folder / self.names[int(self.table[index, 0])]}:{index:09d}"

    def read(self, index: int) -> bytes:
        shard, offset, size, _ = (int(v) for v in self.table[index])
        if os.getpid() != self._pid:  # a forked worker must not share the parent's offsets
            self._files, self._pid = {}, os.getpid()
        fh = self._files.get(shard)
        if fh is None:
            fh = self._files[shard] = open(self.folder / self.names[shard], "rb")
            self.opens += 1
        fh.seek(offset)
        return fh.read(size)

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers get no open files
        return {**self.__dict__, "_files": {}}

    def close(self) -> None:
        for fh in self._files.values():
            fh.close()
        self._files = {}
