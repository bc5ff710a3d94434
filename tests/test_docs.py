"""The documentation stays short where it must and complete where it must: README.md is read in five
minutes, the CLI reference generated from the parser names every subcommand and flag, the README's
tables name every method and KV policy the registries hold, and its links into docs/ resolve.

No mkdocs needed: the CLI reference's generator (``docs/hooks/cli_reference.py``) is called directly.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _cli_reference():
    spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "docs" / "hooks" / "cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


def test_benchmarks_front_page_is_short():
    assert len((ROOT / "BENCHMARKS.md").read_text().splitlines()) <= 420


def test_cli_reference_has_every_subcommand_and_flag():
    from speculum.cli import build_parser

    ref = _cli_reference()
    parser = build_parser()
    text = ref.render(parser)
    commands = ref.subcommands(parser)
    assert [name for name, _, _ in commands] == ["generate", "bench", "calibrate", "longctx", "train-draft",
                                                 "train-duo", "export-head", "serve"]
    for name, _, sub in commands:
        assert f"## speculum {name}\n" in text
        for action in sub._actions:
            if action.help is argparse.SUPPRESS:
                continue
            for option in action.option_strings or [action.dest]:
                assert re.search(rf"`[^`]*(?<![\w-]){re.escape(option)}(?![\w-])", text), (name, option)


def test_readme_names_every_method_and_policy():
    from speculum.kv import POLICY_NAMES
    from speculum.methods import METHODS

    readme = (ROOT / "README.md").read_text()
    for name in (*METHODS, *POLICY_NAMES):
        assert f"`{name}`" in readme, name


def test_readme_links_resolve():
    readme = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme):
        if "://" not in target:
            assert (ROOT / target).exists(), target
