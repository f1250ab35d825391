"""Snapshot: published trainer weights and the version number they carry."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Snapshot:
    state: dict
    version: int
    shared: bool = False  # state holds the trainer's own tensors, not copies (``Snapshot.sharing``)

    def __post_init__(self):
        if self.version is None or not isinstance(self.version, int) or self.version < 0:
            raise ValueError(f"a snapshot needs an integer version >= 0, got {self.version!r}")

    @classmethod
    def of(cls, model, version: int) -> Snapshot:
        from driftless.models.io import clone_state

        return cls(clone_state(model.state_dict()), version)  # tied weights stay one tensor

    @classmethod
    def sharing(cls, model, version: int) -> Snapshot:
        """``model``'s own tensors under ``version``, not copies: an engine in the same process without a mismatch
        view adopts them (``Sampler.load``) and samples from exactly the trainer's weights with no second copy in
        memory. Only for a sampler that takes every version as it is published (a sync run without lag or
        staleness): the tensors change with the next optimizer step."""
        return cls(dict(model.state_dict()), version, shared=True)  # state_dict(): detached, sharing storage
