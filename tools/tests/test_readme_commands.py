"""Every `rlserve train|resume|config` command in README's bash blocks is config-checked
as written: its overrides (and --config file, where it is one of the repository's) load
into a RunConfig without error. A command naming the user's own files (my_run.yaml) is
checked with its overrides alone; model and data paths are not opened (the run does
that, after this check)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from rlserve.core.config import load_config
from rlserve.core.run_config import RunConfig

ROOT = Path(__file__).resolve().parents[2]
RUN_CONFIG_VERBS = ("train", "resume", "config")
BASH_BLOCK = re.compile(r"```bash\n(.*?)```", re.DOTALL)


def readme_commands() -> list[tuple[str, list[str]]]:
    """(the command as written, its arguments after `rlserve`) per README command."""
    commands = []
    for block in BASH_BLOCK.findall((ROOT / "README.md").read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words and words[0].endswith("rlserve") and words[1] in RUN_CONFIG_VERBS:
                commands.append((line.strip(), words[1:]))
    return commands


def test_readme_has_the_commands_this_test_checks():
    verbs = {arguments[0] for _, arguments in readme_commands()}
    assert verbs == set(RUN_CONFIG_VERBS)


@pytest.mark.parametrize(("written", "arguments"), readme_commands())
def test_each_readme_command_is_a_valid_config(written, arguments):
    verb, rest = arguments[0], arguments[1:]
    if verb == "resume":
        rest = rest[1:]  # the run directory; its config.yaml is a checked one
    config_file = None
    if "--config" in rest:
        at = rest.index("--config")
        named = ROOT / rest[at + 1]
        config_file = named if named.is_file() else None  # else the user's own file
        rest = rest[:at] + rest[at + 2 :]
    overrides = [word for word in rest if "=" in word and not word.startswith("-")]
    load_config(RunConfig, config_file, overrides)
