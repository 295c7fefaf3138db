"""The overlay project on disk: where the lock, the overlay and the work area live."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vllm_overlay.overlay.model import Overlay, load_overlay
from vllm_overlay.pin.lockfile import Lock, read_lock
from vllm_overlay.util import project_root


@dataclass(frozen=True)
class Project:
    root: Path

    @property
    def lock_path(self) -> Path:
        return self.root / "upstream.lock"

    @property
    def overlay_dir(self) -> Path:
        return self.root / "overlay"

    @property
    def work_dir(self) -> Path:
        """Ignored scratch space: the default checkout, suite runs, rebase state."""
        return self.root / ".work"

    @property
    def default_checkout(self) -> Path:
        return self.work_dir / "vllm"

    def lock(self) -> Lock:
        return read_lock(self.lock_path)

    def overlay(self) -> Overlay:
        return load_overlay(self.overlay_dir)


def find_project() -> Project:
    return Project(project_root())
