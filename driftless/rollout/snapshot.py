"""Snapshot: published trainer weights and the version number they carry."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Snapshot:
    state: dict
    version: int

    def __post_init__(self):
        if self.version is None or not isinstance(self.version, int) or self.version < 0:
            raise ValueError(f"a snapshot needs an integer version >= 0, got {self.version!r}")

    @classmethod
    def of(cls, model, version: int) -> Snapshot:
        from driftless.models.io import clone_state

        return cls(clone_state(model.state_dict()), version)  # tied weights stay one tensor
