"""Every CLI command is documented, and the reference matches the code."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

from shardledger_cli.cli import COMMAND_MODULES, build_parser
from tools.gen import cli_docs as gen_cli_docs
from tools.gen import config_docs as gen_config_docs


def test_cli_reference_is_generated_from_the_current_help_texts() -> None:
    assert gen_cli_docs.DOC.read_text() == gen_cli_docs.render(), (
        "run: python -m tools.gen.cli_docs"
    )


def test_every_command_module_registers_a_documented_command() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    names = set(sub.choices)
    assert len(names) >= len(COMMAND_MODULES)
    text = gen_cli_docs.DOC.read_text()
    for name in names:
        assert f"## `shardledger {name}`" in text
        assert sub.choices[name].description or sub.choices[name].format_help()


def test_console_script_help_lists_commands_and_exit_codes() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "shardledger_cli", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "exit codes: 0 ok, 1 problems found" in out.stdout
    for name in ("serve", "plan", "status", "resume", "verify", "audit", "demo", "watch", "token"):
        assert name in out.stdout


def test_configuration_page_is_generated_from_the_parser_and_the_sources() -> None:
    assert gen_config_docs.problems() == [], "describe each variable in tools/gen/config_docs.py"
    assert gen_config_docs.DOC.read_text() == gen_config_docs.render(), (
        "run: python -m tools.gen.config_docs"
    )


def test_configuration_page_names_every_variable_the_code_reads_and_every_flag() -> None:
    text = gen_config_docs.DOC.read_text()
    for name in gen_config_docs.variables_in_code():
        assert f"| `{name}` |" in text
    for flag in ("`--db`, `--database-url`", "`--format`", "`--shard`", "`--tls-cert`"):
        assert flag in text


DOCS = gen_config_docs.ROOT / "docs"

# A heading that dates a page by who worked on it rather than what it describes.
DIARY_HEADING = re.compile(r"^#{1,6} .*\b(sessions?\b|issue #?\d+)", re.IGNORECASE | re.MULTILINE)
FENCED_BLOCK = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)


def diary_headings(text: str) -> list[str]:
    """Returns the headings of a Markdown text that name a session or an issue (code blocks aside)."""
    return [m.group(0) for m in DIARY_HEADING.finditer(FENCED_BLOCK.sub("", text))]


def test_pages_describe_the_product_as_it_is_with_no_session_or_issue_headings() -> None:
    # What changed when, and in which issue, is CHANGELOG.md's; a page says what is.
    pages = [*sorted(DOCS.rglob("*.md")), gen_config_docs.ROOT / "README.md"]
    found = [f"{page.name}: {h}" for page in pages for h in diary_headings(page.read_text())]
    assert not found, "move these sections' history to CHANGELOG.md:\n" + "\n".join(found)
    assert diary_headings("## Results against the targets (issue #8)\n#### Session 10: again\n")
    assert not diary_headings("```bash\n# issue 5 is a comment\n```\n## Ingest\n")


def test_concepts_page_shows_the_flow_diagram_as_well_formed_svg() -> None:
    import xml.etree.ElementTree as ET

    text = (DOCS / "concepts.md").read_text()
    assert "](img/flow.svg)" in text
    root = ET.parse(DOCS / "img" / "flow.svg").getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    shown = " ".join("".join(t.itertext()) for t in root.iter("{http://www.w3.org/2000/svg}text"))
    for stage in ("plan", "run", "commit", "verify", "resume"):
        assert stage in shown
    for call in (
        "shardledger plan RUN",
        "ledger.shard(",
        "shard.atomic_write(",
        "shardledger verify",
    ):
        assert call in shown
    for where in ("README.md", "docs/design.md"):
        assert "concepts.md" in (gen_config_docs.ROOT / where).read_text(), where


def test_concepts_page_defines_every_state_reason_alias_and_summary_field() -> None:
    from collections import Counter

    from ledger_server.projections import RESUME_DETAIL_PREFIXES, RESUME_REASONS
    from ledger_server.states import QUERY_ALIASES, QUERY_STATES
    from ledger_server.summary import run_summary

    text = (DOCS / "concepts.md").read_text()
    summary = run_summary(Counter(), stale=0, run_id="r", namespace="n", last_event_us=0, now_us=0)
    # The server adds these three to what the projections compute (service.summary).
    fields = [*summary, "event_count", "head_hash", "as_of_us"]
    names = [*QUERY_STATES, *RESUME_REASONS.values(), *QUERY_ALIASES]
    names += [
        p + "TAG" if p == "failed:" else p + "REASON" for p in RESUME_DETAIL_PREFIXES.values()
    ]
    undefined = [n for n in [*fields, *names] if f"`{n}`" not in text]
    assert not undefined, f"docs/concepts.md does not define {undefined}"
