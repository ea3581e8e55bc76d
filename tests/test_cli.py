"""`pdmask --help`: one line per subcommand saying what it does, without importing any subcommand's module."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdmask.cli import COMMANDS, main


def test_help_says_what_each_command_does_in_one_line(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse puts a long name and its line on two rows
    for name, (_, summary) in COMMANDS.items():
        assert f"{name} {summary}" in out, name
        assert "see `pdmask" not in out
    assert main([]) == 0  # no command: the same help
    assert " ".join(capsys.readouterr().out.split()) == out


def test_help_imports_no_subcommand():
    code = "import sys; from pdmask.cli import COMMANDS, main; main([]); print([m for m, _ in COMMANDS.values() if m in sys.modules])"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip().splitlines()[-1] == "[]"
