"""Write docs/cli.md from the commands' argparse parsers: every option of every command, and the
environment variables the project reads.

    python -m tools.cli_doc            # rewrite docs/cli.md
    python -m tools.cli_doc --check    # exit 1 when docs/cli.md differs from what it would write

The commands are pyproject.toml's [project.scripts]; COMMAND_PARSERS names the function that
builds each one's parser. tests/test_cli_doc.py fails when docs/cli.md is stale, when a command
is missing here, when an option has no help text or does not say its default, and when the
source reads a HELIOS_* variable ENVIRONMENT does not list.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "cli.md"

# console script -> "module:function" that returns its argparse parser
COMMAND_PARSERS: dict[str, str] = {
    "helios-serve": "helios_backend.cli.serve:parser",
    "helios-gateway": "gateway.cli:_parser",
    "helios-prepare": "ignition.cli:_parser",
    "helios-core": "helios_backend.cli.core:build_parser",
    "helios-generate": "helios_backend.cli.generate:_parser",
    "helios-rank": "helios_backend.cli.rank:parser",
}

# (variable, who reads it, what it does). Variables the project only sets for its own child
# processes are listed too, so an operator knows not to set them.
ENVIRONMENT: tuple[tuple[str, str, str], ...] = (
    ("HELIOS_API_KEY", "helios-gateway, helios-serve",
     "the Bearer key the gateway requires when no --api-key is given (unset or empty: no key)"),
    ("HELIOS_HOME", "helios-prepare, helios-core, helios-serve --model",
     "where the publisher key lives: $HELIOS_HOME/keys/publisher.ed25519.pem "
     "(default: ~/.local/share/helios)"),
    ("HELIOS_CORE_CACHE", "helios-serve --model",
     "where the cores of checkpoint folders are prepared and kept, keyed by the folder's content, with "
     "the remembered weight digests (weight-digests.json) (default: ~/.cache/helios/cores)"),
    ("HELIOS_SOURCE_CACHE", "helios-prepare",
     "where packaged weight sources are reassembled (default: ~/.cache/helios/sources)"),
    ("HELIOS_CPU_ISA", "the serving process, executor cpu",
     "the instruction set the CPU executor's kernels are compiled for: auto (the widest this CPU runs), avx512, "
     "avx2 or host; a path the CPU cannot run is a startup error (docs/cpu-executor.md) (default: auto)"),
    ("HELIOS_FAULT_TRIGGER", "the serving process (tests only)",
     "a file whose content crashes an engine thread on purpose (helios_backend/engine/faults.py); "
     "never set it in production"),
    ("HELIOS_GATEWAY_CONFIG", "helios-gateway --workers N (internal)",
     "the settings the parent passes to its worker processes; set by helios-gateway, never by hand"),
    ("PROMETHEUS_MULTIPROC_DIR", "helios-gateway --workers N (internal)",
     "the worker processes' shared metric files; set by helios-gateway, never by hand"),
)


def commands() -> list[str]:
    """The console scripts pyproject.toml installs."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        return list(tomllib.load(f)["project"]["scripts"])


def build_parser(command: str) -> argparse.ArgumentParser:
    module, function = COMMAND_PARSERS[command].split(":")
    factory: Callable[[], argparse.ArgumentParser] = getattr(importlib.import_module(module), function)
    return factory()


def subcommands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, str, argparse.ArgumentParser]]:
    """("", "", parser) then (name, its help, subparser) for each subcommand."""
    yield "", "", parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, sub in action.choices.items():
                yield name, helps.get(name, ""), sub


def documented_actions(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    """The options and positionals a user types (not --help, not the subcommand selector)."""
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        yield action


def _flags(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    if isinstance(action, argparse.BooleanOptionalAction):
        return " / ".join(f"`{s}`" for s in action.option_strings)
    if action.nargs == 0:
        return ", ".join(f"`{s}`" for s in action.option_strings)
    metavar = action.metavar or (("{" + ",".join(map(str, action.choices)) + "}") if action.choices
                                 else action.dest.upper())
    return ", ".join(f"`{s} {metavar}`" for s in action.option_strings)


def help_text(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help as --help prints it (%(default)s and friends expanded), on one line."""
    formatter = parser._get_formatter()
    text = formatter._expand_help(action) if action.help else ""
    return " ".join(text.split()).replace("|", "\\|")


def _table(parser: argparse.ArgumentParser) -> list[str]:
    lines = ["| option | meaning |", "|---|---|"]
    for action in documented_actions(parser):
        lines.append(f"| {_flags(action)} | {help_text(parser, action)} |")
    return lines


def render() -> str:
    out = ["# Commands and environment", "",
           "Generated from the commands' argparse parsers by `python -m tools.cli_doc` (tests/test_cli_doc.py "
           "fails when this page is stale): edit the help text in the code, then run it again. "
           "`COMMAND --help` prints the same.", ""]
    for command in commands():
        parser = build_parser(command)
        out += [f"## {command}", "", " ".join((parser.description or "").strip().split("\n\n")[0].split()), ""]
        for name, summary, sub in subcommands(parser):
            if name:
                out += [f"### {command} {name}", "", summary, ""]
            if any(True for _ in documented_actions(sub)):
                out += _table(sub) + [""]
    out += ["## Environment variables", "", "| variable | read by | meaning |", "|---|---|---|"]
    out += [f"| `{name}` | {who} | {meaning} |" for name, who, meaning in ENVIRONMENT]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = argparse.ArgumentParser(prog="python -m tools.cli_doc", description=__doc__.split("\n\n")[0])
    args.add_argument("--check", action="store_true",
                      help="exit 1 when docs/cli.md differs instead of writing it (default: write it)")
    options = args.parse_args(argv)
    text = render()
    if options.check:
        if not DOC.exists() or DOC.read_text() != text:
            print(f"{DOC.relative_to(ROOT)} is stale: run python -m tools.cli_doc", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
