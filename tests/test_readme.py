"""The README's shell commands work as written on a fresh machine, where nothing but ``./dev`` is on hand:
every command line of its ``bash`` blocks goes through ``./dev`` (``./dev run`` puts ``.venv/bin`` in front
of ``PATH``), every ``./dev run`` command names a program ``.venv`` provides, every file it passes exists
(or is written by an earlier command), and every ``fxpar train`` line says where its data comes from."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV_PROGRAMS = {"fxpar", "torchrun", "python", "pytest"}


def _commands() -> list[str]:
    """Each command of the README's bash blocks, continuation lines joined, comments dropped."""
    text = (ROOT / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #", 1)[0].strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def test_readme_commands_go_through_dev_and_name_what_exists():
    commands = _commands()
    assert len(commands) >= 20, commands
    for cmd in commands:
        words = shlex.split(cmd)
        words = [w for w in words if not re.fullmatch(r"[A-Z_]+=\S*", w)]  # FXPAR_DUMP_DIR=out in front
        assert words[0] == "./dev", f"README command not run through ./dev (not on PATH on a fresh machine): {cmd}"
        assert words[1] in ("demo", "test", "run", "lint", "setup", "gpu"), cmd
        if words[1] != "run":
            continue
        assert words[2] in VENV_PROGRAMS, f"./dev run {words[2]}: not a program .venv provides: {cmd}"
        if words[2] == "python":
            assert (ROOT / words[3]).is_file(), f"{words[3]} does not exist: {cmd}"
        if words[2] == "fxpar" and "train" in words[3:6]:
            assert "--data" in words, f"a train command without --data (required): {cmd}"
        for w in words[3:]:
            if w.startswith(("examples/", "bench/")):
                assert (ROOT / w).exists(), f"{w} does not exist: {cmd}"
