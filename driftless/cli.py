"""The ``driftless`` command (also ``python -m driftless``): a thin dispatcher.

Each command registers itself beside its code (``driftless.commands.command``): the library's in
``train/commands.py`` and ``audit/commands.py``, the recipes' in ``recipes/commands.py``. This file
builds the parser from the registry, runs the command, and turns bad input into one line.
"""

from __future__ import annotations

import argparse
import sys

from driftless.audit import commands as _audit_commands  # noqa: F401  (registers: audit)
from driftless.commands import COMMANDS
from driftless.recipes import commands as _recipe_commands  # noqa: F401  (registers: the recipes' commands)
from driftless.train import commands as _train_commands  # noqa: F401  (registers: train, eval, replay, ...)


class _OneLineHelp(argparse.HelpFormatter):
    """``driftless --help``: each command and its help on one line (argparse sizes the column without the
    commands' names, and wraps at the terminal's width)."""

    def __init__(self, prog):
        super().__init__(prog, width=110, max_help_position=30)

    def add_argument(self, action):
        super().add_argument(action)
        if isinstance(action.choices, dict):  # the commands (a subparsers action): each listed indented by 4
            self._action_max_length = max(self._action_max_length, 4 + max(map(len, action.choices)))


def parser() -> argparse.ArgumentParser:
    """The ``driftless`` parser: one subcommand per registered command: the library's, then the recipes'."""
    top = argparse.ArgumentParser(
        prog="driftless", formatter_class=_OneLineHelp,
        description="RL for language models that stays stable when the rollout engine and the trainer disagree. "
                    "Each command's options: driftless COMMAND --help.")
    top.add_argument("--debug", action="store_true", help="on an error, show its traceback")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for c in sorted(COMMANDS.values(), key=lambda c: c.run.__module__.startswith("driftless.recipes")):  # library first
        p = sub.add_parser(c.name, help=c.help, description=c.description)
        c.arguments(p)
        p.set_defaults(func=c.run)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except Exception as err:
        if args.debug or not _user_error(err):
            raise
        print(f"driftless: error: {_one_line(err)}", file=sys.stderr)
        return 2


def _user_error(err: BaseException) -> bool:
    """Bad input (a config, a path, a file's content) or an optional extra that is not installed: one line,
    no traceback (``--debug`` shows it). Anything else is a bug and keeps its traceback."""
    import yaml

    return isinstance(err, (ValueError, ImportError, OSError, yaml.YAMLError))


def _one_line(err: BaseException) -> str:
    if isinstance(err, FileNotFoundError) and err.filename:
        return f"{err.filename}: no such file or directory"
    if isinstance(err, OSError) and err.filename:
        return f"{err.filename}: {err.strerror or err}"
    text = " ".join(str(err).split()) if not isinstance(err, ValueError) else str(err).strip()
    return text or type(err).__name__


if __name__ == "__main__":
    raise SystemExit(main())
