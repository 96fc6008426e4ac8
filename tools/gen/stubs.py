"""Regenerates the committed protobuf/gRPC stubs under shard_client/api.

Run `python -m tools.gen.stubs` after editing proto/; `--check` exits 1 when
the committed stubs differ from what the generator produces (CI runs it).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = ROOT / "proto"
OUT_ROOT = ROOT / "shard_client" / "api"
# The generated modules import each other as `shardledger.v1...`; both the SDK
# and the server import them from inside the SDK package, so imports are
# rewritten to that single location.
_IMPORT_RE = re.compile(r"^from shardledger\.v1 import", re.MULTILINE)
_PACKAGE_IMPORT = "from shard_client.api.shardledger.v1 import"


def generate(out_root: Path) -> list[Path]:
    """Generates stubs for every .proto into out_root and returns the files written."""
    from grpc_tools import protoc  # dev-only dependency, imported lazily

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    written = []
    # .py and .pyi only: an interpreter's __pycache__/*.pyc may lie beside them.
    generated = [*out_root.rglob("*.py"), *out_root.rglob("*.pyi")]
    for path in sorted(generated):
        text = _IMPORT_RE.sub(_PACKAGE_IMPORT, path.read_text())
        path.write_text(text)
        written.append(path)
    folders = {out_root}
    for path in written:
        folders.update(d for d in path.parents if out_root in (d, *d.parents))
    for folder in sorted(folders):
        init = folder / "__init__.py"
        if not init.exists():
            init.write_text(
                '"""Generated code: never edit by hand; run python -m tools.gen.stubs."""\n'
            )
            written.append(init)
    return written


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): p.read_text()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def main(argv: list[str] | None = None) -> int:
    """Regenerates the stubs, or with --check reports whether they are stale."""
    parser = argparse.ArgumentParser(prog="python -m tools.gen.stubs", description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if the stubs are stale")
    args = parser.parse_args(argv)
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            generate(Path(tmp))
            fresh, committed = _tree(Path(tmp)), _tree(OUT_ROOT)
        stale = sorted(
            k for k in fresh.keys() | committed.keys() if fresh.get(k) != committed.get(k)
        )
        if stale:
            print("stale generated stubs: " + ", ".join(stale), file=sys.stderr)
            print("run: python -m tools.gen.stubs", file=sys.stderr)
            return 1
        print("generated stubs are fresh")
        return 0
    OUT_ROOT.mkdir(parents=True, exist_ok=True)
    for path in generate(OUT_ROOT):
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
