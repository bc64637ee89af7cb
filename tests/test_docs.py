"""Every `decentral ...` command the docs show (README.md's and BENCHMARKS.md's code blocks, the example scripts,
each --help's example) is one the CLI takes: its options exist, their values parse, and a demo's or train's
`--protocol` and `--set` make a valid recipe. Commands are parsed, not run."""
import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from decentral.cli import _options_before_a_suite, _recipe, build_parser

ROOT = Path(__file__).resolve().parents[1]
COMMAND = re.compile(r"(?:^|[\s;&|(])decentral (\S.*)")
SHELL_ENDS = re.compile(r"\s(?:&&|\|\|?|;|>>?|2>|&)(?:\s|$)")


def _logical_lines(lines: list[str]):
    """(line number, line) with backslash continuations joined."""
    i = 0
    while i < len(lines):
        start, line = i + 1, lines[i]
        while line.endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line[:-1] + " " + lines[i].strip()
        yield start, line
        i += 1


def _commands_in(lines: list[str], where: str):
    for number, line in _logical_lines(lines):
        if line.lstrip().startswith("#") or not (found := COMMAND.search(line)):
            continue
        command = SHELL_ENDS.split(found.group(1).split(" #")[0])[0].strip()
        if "$" not in command and "<" not in command:  # (shell expansions and placeholders: not literal)
            yield pytest.param(command, id=f"{where}:{number}")


def _doc_commands():
    for name in ("README.md", "BENCHMARKS.md"):
        lines, block, inside = (ROOT / name).read_text().splitlines(), [], False
        for line in lines:
            if line.startswith("```"):
                inside = not inside
                block.append("")  # (keeps line numbers)
                continue
            block.append(line if inside else "")
        yield from _commands_in(block, name)
    for script in sorted((ROOT / "examples").glob("*.sh")):
        yield from _commands_in(script.read_text().splitlines(), f"examples/{script.name}")


def _help_examples(parser: argparse.ArgumentParser, path: str = "decentral"):
    _, _, block = (parser.epilog or "").partition("example:\n")
    yield from _commands_in([line.strip() for line in block.splitlines()], f"{path} --help")
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _help_examples(sub, f"{path} {name}")


DOC_COMMANDS = list(_doc_commands())
HELP_EXAMPLES = list(_help_examples(build_parser()))


def _parse(command: str) -> argparse.Namespace | None:
    """The command's arguments, None for a `--help` (it exits 0); a parser's error fails the test."""
    errors = io.StringIO()
    with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
        try:
            return build_parser().parse_args(shlex.split(command))
        except SystemExit as exit:
            if not exit.code:
                return None
    pytest.fail(f"decentral {command}\n{errors.getvalue().strip()}")


def test_the_docs_show_commands_at_all():
    """(The extraction finds them: a change that found none would pass every check below.)"""
    assert len(DOC_COMMANDS) > 100 and len(HELP_EXAMPLES) > 20
    assert any(param.values[0].startswith("demo") for param in DOC_COMMANDS)


@pytest.mark.parametrize("command", DOC_COMMANDS + HELP_EXAMPLES)
def test_a_documented_command_parses(command, monkeypatch):
    if (args := _parse(command)) is None:
        return
    assert _options_before_a_suite(shlex.split(command), args) is None
    monkeypatch.chdir(ROOT)  # (recipe files are named from the repository's root)
    placeholder = Path(getattr(args, "protocol", "")).suffix in (".yaml", ".yml") and not Path(args.protocol).is_file()
    if args.command in ("demo", "train") and not placeholder:  # (BENCHMARKS.md's `--protocol R.yaml`)
        _recipe(args)  # a RecipeError (an unknown --set key, a bad value) fails the test


def test_the_readme_and_help_list_the_same_exit_codes():
    """(--help lacked 141, which the README listed.)"""
    from decentral.cli import EXIT_CODES

    readme = set(re.findall(r"^\| (\d+) \|", (ROOT / "README.md").read_text(), re.M))
    helped = set(re.findall(r"^  (\d+) ", EXIT_CODES, re.M))
    assert readme and readme == helped, (readme, helped)
