"""Every option of every command says what it does and its default, and docs/cli.md is what
tools/cli_doc.py generates from the parsers (stale docs fail here)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from tools import cli_doc

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("helios_backend", "gateway", "ignition", "model_repository")
# actions whose default needs no words: a flag that is off unless given, a required option, a positional
_SELF_EVIDENT = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._VersionAction)


def test_every_installed_command_has_its_parser_named() -> None:
    assert sorted(cli_doc.COMMAND_PARSERS) == sorted(cli_doc.commands())


@pytest.mark.parametrize("command", sorted(cli_doc.COMMAND_PARSERS))
def test_every_option_has_help_that_names_its_default(command: str) -> None:
    parser = cli_doc.build_parser(command)
    for name, _, sub in cli_doc.subcommands(parser):
        for action in cli_doc.documented_actions(sub):
            where = f"{command} {name} {action.option_strings or action.dest}"
            text = cli_doc.help_text(sub, action)
            assert text, f"{where} has no help text"
            if action.option_strings and not action.required and not isinstance(action, _SELF_EVIDENT):
                assert "default" in text, f"{where}: its help does not say its default: {text!r}"


def test_docs_cli_md_is_generated_from_the_parsers() -> None:
    expected = cli_doc.render()
    assert (ROOT / "docs" / "cli.md").read_text() == expected, "docs/cli.md is stale: run python -m tools.cli_doc"
    assert cli_doc.main(["--check"]) == 0


def test_the_page_lists_every_environment_variable_the_code_reads() -> None:
    named = set()
    for package in SOURCES:
        for source in (ROOT / package).rglob("*.py"):
            named |= set(re.findall(r"[\"'](HELIOS_[A-Z0-9_]+)[\"']", source.read_text()))
    listed = {name for name, _, _ in cli_doc.ENVIRONMENT}
    assert named, "no HELIOS_* variable found: the scan is broken"
    assert named <= listed, f"read but not in tools/cli_doc.py ENVIRONMENT: {sorted(named - listed)}"
    page = (ROOT / "docs" / "cli.md").read_text()
    assert all(f"`{name}`" in page for name in listed)


def test_a_changed_help_text_makes_the_page_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    original = cli_doc.build_parser

    def changed(command: str) -> argparse.ArgumentParser:
        parser = original(command)
        if command == "helios-rank":
            parser.add_argument("--new-option", default=1, help="an option the page does not list (default: 1)")
        return parser

    monkeypatch.setattr(cli_doc, "build_parser", changed)
    assert cli_doc.main(["--check"]) == 1
