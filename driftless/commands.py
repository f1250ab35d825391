"""The ``driftless`` command's registry: each command registers itself beside its code.

A command is a name, a one-line help, a function that adds its arguments to an argparse parser and a
function that runs it (``args -> exit status``). Command modules (``train/commands.py``,
``audit/commands.py``, ``recipes/commands.py``) import nothing heavy at module level, so that
``driftless --help`` lists every command without loading torch; ``cli.py`` imports them and dispatches.

Settings that are config keys are given as train gives them (``a.b=c``, checked by train's schema):
:func:`given_keys`. A command's own flags are only for what is not a config key (paths, output).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    name: str
    help: str  # one line, in ``driftless --help``
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    description: str | None = None


COMMANDS: dict[str, Command] = {}


def command(name: str, help: str, *, arguments: Callable[[argparse.ArgumentParser], None],
            description: str | None = None):
    """Register the decorated ``run(args) -> int`` as ``driftless NAME``."""

    def register(run: Callable[[argparse.Namespace], int]):
        if name in COMMANDS:
            raise ValueError(f"driftless {name}: registered twice ({COMMANDS[name].run.__module__} and "
                             f"{run.__module__})")
        COMMANDS[name] = Command(name, help, arguments, run, description)
        return run

    return register


def given_keys(command: str, overrides: list[str], allowed: tuple[str, ...]) -> dict[str, object]:
    """The ``a.b=c`` settings a command was given, by train's names: checked by train's schema (names, types,
    ranges; an unknown key is refused with the nearest valid name), then refused by name if this command does
    not take that key. ``{key: value}`` for the keys given, in train's types."""
    from driftless.train.config import load_config

    config = load_config(None, overrides)
    keys = [o.split("=", 1)[0] for o in overrides]
    other = [k for k in keys if k not in allowed]
    if other:
        raise ValueError(f"{command}: {other[0]} is a config key this command does not take; it takes "
                         f"{', '.join(allowed)}")
    out = {}
    for key in keys:
        section, name = key.split(".", 1)
        out[key] = getattr(getattr(config, section), name)
    return out
