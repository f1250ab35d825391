"""The layer table of docs/architecture.md holds: lint-imports checks pyproject's contracts."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert exe, "lint-imports (import-linter, a dev dependency) is not installed"
    proc = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "5 kept, 0 broken" in proc.stdout  # layers, library never imports recipes, models, sources, train


def test_no_rollout_source_builds_a_learner():
    """The run builds its learner once (train.learners.make_learner) and hands it to its source: no module of
    train/sources calls a learner's builder or constructor (the import contract forbids importing them)."""
    import ast

    builders = {"learner", "make_learner", "remote_learner", "Learner", "RemoteLearner"}
    found = []
    for path in sorted((ROOT / "driftless/train/sources").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                if name in builders:
                    found.append(f"{path.name}:{node.lineno} {ast.unparse(f)}(...)")
    assert not found, found
