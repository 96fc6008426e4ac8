"""Copies included files into the docs' include regions: python -m tools.gen.sync_docs [--check].

A region is ``<!-- include: PATH -->``, a fenced code block, ``<!-- end include -->``;
the block's body is PATH's text (relative to the repository root), byte for byte.
``tests/test_tutorial.py`` fails while a region differs from its file.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Final

REPO: Final = Path(__file__).resolve().parents[2]
DOCS: Final = (REPO / "docs" / "tutorial.md", REPO / "README.md")
INCLUDE: Final = re.compile(
    r"(?P<open><!-- include: (?P<path>[^ ]+) -->\n```(?P<lang>\w*)\n)"
    r"(?P<body>.*?)"
    r"(?P<close>```\n<!-- end include -->)",
    re.DOTALL,
)


def includes(text: str) -> list[tuple[str, str]]:
    """Returns (path, body) of every include region in a document, in order."""
    return [(m["path"], m["body"]) for m in INCLUDE.finditer(text)]


def render(text: str, root: Path = REPO) -> str:
    """Returns the document with every include region's body replaced by its file's text."""

    def fill(match: re.Match[str]) -> str:
        body = (root / match["path"]).read_text(encoding="utf-8")
        if not body.endswith("\n"):
            body += "\n"
        return match["open"] + body + match["close"]

    return INCLUDE.sub(fill, text)


def main(argv: Sequence[str] | None = None) -> int:
    """Rewrites the docs whose include regions are stale; with --check only names them (exit 1)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if stale")
    args = parser.parse_args(argv)
    stale = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        fresh = render(text)
        if fresh != text:
            stale.append(doc.relative_to(REPO))
            if not args.check:
                doc.write_text(fresh, encoding="utf-8")
    for path in stale:
        print(f"{path}: {'stale' if args.check else 'updated'}")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
