"""docs/configuration.md is what tools/gen_config_docs.py writes from the code now, and
the generator drops no line of `rlserve config --describe` on the way."""

from __future__ import annotations

import runpy
from pathlib import Path

from rlserve.core.config import describe_config
from rlserve.core.run_config import RunConfig

REPO = Path(__file__).resolve().parents[2]
gen = runpy.run_path(str(REPO / "tools" / "gen_config_docs.py"))


def test_configuration_page_is_fresh():
    committed = (REPO / "docs" / "configuration.md").read_text()
    assert committed == gen["render"](), (
        "docs/configuration.md differs from the run config's field docs: "
        "run `.venv/bin/python tools/gen_config_docs.py` and commit the result"
    )


def test_every_described_field_reaches_the_page():
    described = describe_config(RunConfig)
    # Every entry line of describe (not its indented docs and choices) is one section or
    # field of the parsed tree; count both, so a line the parser skipped would show.
    entries = [line.split(":")[0] for line in described.splitlines() if not line[0].isspace()]

    def paths(sections):
        for section in sections:
            yield section.path
            yield from (entry.path for entry in section.fields)
            yield from paths(section.sections)

    parsed = list(paths(gen["parse"](described)))
    assert sorted(parsed) == sorted(entries)
    page = gen["render"]()
    missing = [path for path in entries if f"`{path}`" not in page and f"# {path}\n" not in page]
    assert not missing, f"fields missing from the page: {missing}"
