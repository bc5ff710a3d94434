"""Which of ``auto``'s learned arms did not pay on this machine and model, remembered across runs.

A learned arm (EAGLE, Medusa, ... drafting with a trained head) runs forwards of its own and reads
the target's hidden states at every step, whichever arm drafted it. Where a draft costs more than
its accepted tokens save (a CPU whose verification rows are not free, a head that matches the
target poorly), ``auto`` retires the arm (:meth:`~speculum.drafters.auto.AutoDrafter.start_step`)
and records it here; a later run with the same key does not build it. The key is the forward-cost
calibration's (model configuration, dtype, device, machine, kernels: :mod:`speculum.calibrate`),
an arm is named by its kind and head file. The record is one JSON file under
``$SPECULUM_CACHE/calibration/``; delete it to let ``auto`` try those arms again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..models import cache_dir


class ArmMemory:
    """The retired arms of one calibration key (a set of arm names, persisted as a JSON list)."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.names = set(json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            self.names = set()

    @classmethod
    def for_key(cls, key: str) -> ArmMemory:
        return cls(cache_dir() / "calibration" / f"{key}-auto-retired.json")

    def retire(self, name: str) -> None:
        """Record ``name`` (written at once; a write that fails leaves it retired in this process only)."""
        self.names.add(name)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(sorted(self.names)))
            tmp.replace(self.path)
        except OSError:
            pass


def arm_name(kind: str, head: str | os.PathLike | None) -> str:
    """What the memory calls a learned arm: its kind and the head file it drafts with."""
    return f"{kind}:{Path(head).resolve() if head else ''}"
