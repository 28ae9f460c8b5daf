"""The console script's entry point: a Ctrl-C while the command line imports (the first half
second of any `aphrodite` command) exits 130 without a traceback; otherwise it runs the
command line."""

from __future__ import annotations

import sys

import pytest

from aphrodite_cli import entry


class _Interrupting:
    """A finder that raises what a Ctrl-C raises in the middle of an import."""

    def find_spec(self, name, path=None, target=None):
        if name == "aphrodite_cli.main":
            raise KeyboardInterrupt
        return None


def test_a_ctrl_c_while_the_command_line_imports_exits_130(monkeypatch):
    monkeypatch.delitem(sys.modules, "aphrodite_cli.main", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_Interrupting(), *sys.meta_path])
    with pytest.raises(SystemExit) as stopped:
        entry.main()
    assert stopped.value.code == 130


def test_otherwise_it_runs_the_command_line(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["aphrodite", "--version"])
    with pytest.raises(SystemExit) as done:
        entry.main()
    assert done.value.code == 0
    from engine.version import __version__

    assert __version__ in capsys.readouterr().out
