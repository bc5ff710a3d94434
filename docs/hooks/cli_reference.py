"""The CLI reference page, generated from ``speculum``'s argparse parser when the site is built.

mkdocs runs this file as a hook (``mkdocs.yml``, ``hooks:``): the Markdown of ``docs/cli.md`` (a
placeholder in the repository) is replaced by :func:`render`, which walks
:func:`speculum.cli.build_parser` and writes every subcommand with its usage, description, argument
groups and every flag with its default and help. Nothing of the reference is written by hand, so it
cannot drift from the code. ``tests/test_docs.py`` calls :func:`render` directly (no mkdocs needed).
"""

from __future__ import annotations

import argparse
import re

WIDTH = 100  # usage lines wrap here, whatever the terminal


def _parser() -> argparse.ArgumentParser:
    from speculum.cli import build_parser

    return build_parser()


def subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """``(name, one-line help, subparser)`` for every subcommand, in ``--help``'s order."""
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    helps = {a.dest: a.help or "" for a in action._choices_actions}
    return [(name, helps.get(name, ""), sub) for name, sub in action.choices.items()]


def _escape(text: str) -> str:
    """Markdown-safe text for a table cell or paragraph; spans in backticks are kept as code."""
    out = []
    for i, part in enumerate(re.split(r"(`[^`]*`)", text)):
        if i % 2:  # a code span
            out.append(part.replace("|", "\\|"))
            continue
        part = part.replace("\\", "\\\\").replace("<", "&lt;").replace(">", "&gt;")
        for ch in "*_[]|":
            part = part.replace(ch, "\\" + ch)
        out.append(part)
    return " ".join("".join(out).split())


def _usage(sub: argparse.ArgumentParser) -> str:
    formatter = argparse.HelpFormatter(sub.prog, width=WIDTH)
    formatter.add_usage(sub.usage, sub._actions, sub._mutually_exclusive_groups)
    return formatter.format_help().strip()


def _default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    if action.default is None or action.default is argparse.SUPPRESS or action.nargs == 0:
        return ""
    if isinstance(action.default, (list, tuple, str)) and not action.default:
        return ""
    return f"`{action.default}`"


def _rows(sub: argparse.ArgumentParser, actions: list[argparse.Action]) -> list[str]:
    formatter = argparse.HelpFormatter(sub.prog, width=WIDTH)
    rows = []
    for action in actions:
        if action.help is argparse.SUPPRESS:
            continue
        invocation = formatter._format_action_invocation(action)
        text = formatter._expand_help(action) if action.help else ""
        rows.append(f"| `{invocation}` | {_default(action)} | {_escape(text)} |")
    return rows


def render_command(name: str, summary: str, sub: argparse.ArgumentParser) -> str:
    """One subcommand's section: heading, summary, usage, description, then a table per argument group."""
    lines = [f"## speculum {name}", "", _escape(summary[:1].upper() + summary[1:]) + ".", "",
             "```", _usage(sub), "```", ""]
    if sub.description:
        lines += [_escape(sub.description), ""]
    for group in sub._action_groups:
        actions = [a for a in group._group_actions if a.help is not argparse.SUPPRESS]
        if not actions:
            continue
        title = {"options": "Options", "optional arguments": "Options",
                 "positional arguments": "Positional arguments"}.get(group.title, group.title)
        lines += [f"**{_escape(title[:1].upper() + title[1:])}**", ""]
        if group.description:
            lines += [_escape(group.description), ""]
        lines += ["| option | default | description |", "|---|---|---|", *_rows(sub, actions), ""]
    if sub.epilog:
        if "\n" in sub.epilog:
            lines += ["```", sub.epilog.strip("\n"), "```", ""]
        else:
            lines += [_escape(sub.epilog), ""]
    return "\n".join(lines)


def render(parser: argparse.ArgumentParser | None = None) -> str:
    """The whole CLI reference as Markdown."""
    parser = parser or _parser()
    commands = subcommands(parser)
    lines = [
        "# CLI reference",
        "",
        ("Generated from the `speculum` argparse parser (`speculum.cli.build_parser`) each time the site is "
         "built, so every subcommand and flag below is the code's. `speculum COMMAND --help` prints the same."),
        "",
        _escape(parser.description or ""),
        "",
        "```",
        _usage(parser),
        "```",
        "",
        "| command | what it does |",
        "|---|---|",
        *[f"| [`{name}`](#speculum-{name}) | {_escape(summary)} |" for name, summary, _ in commands],
        "",
        ("Mistakes that speculum checks (an unknown model or method, a bad parameter, an empty prompt, ...) "
         "print one line `speculum: error: ...` and exit with status 2; argparse's own (an unknown flag, a "
         "missing value) print the usage and exit with status 2 too."),
        "",
    ]
    for name, summary, sub in commands:
        lines.append(render_command(name, summary, sub))
    return "\n".join(lines)


def on_page_markdown(markdown: str, page, config, files) -> str:  # mkdocs hook
    if page.file.src_uri == "cli.md":
        return render()
    return markdown
