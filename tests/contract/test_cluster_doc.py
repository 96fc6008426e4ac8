"""docs/cluster.md runs as written: certificates, tokens, a TLS ledger that demands them.

The page's shell blocks run in order in one temp directory (the helpers and rules of
test_tutorial.py). Its `serve` block is marked not run because it listens on
0.0.0.0:50551; this test starts that same command line on 127.0.0.1 and a free port.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Final

import pytest

from tests.contract.test_tutorial import SHELLS, blocks, missing_lines, script

REPO: Final = Path(__file__).resolve().parents[2]
CLUSTER: Final = REPO / "docs" / "cluster.md"
DOC_LISTEN: Final = "--listen 0.0.0.0:50551"


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDLEDGER_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("PYTHONPATH", None)
    # What step 0 tells the reader to set, in temporary places.
    env["LEDGER_DIR"] = str(tmp_path / "etc")
    env["LEDGER_DB"] = str(tmp_path / "lib" / "ledger.db")
    env["LEDGER_HOST"] = "ledger.example.org"
    env["HOME"] = str(tmp_path / "home")
    env["SHARDLEDGER_SPOOL_DIR"] = str(tmp_path / "spool")
    for d in ("etc", "lib", "home"):
        (tmp_path / d).mkdir()
    return env


def _serve(body: str, env: dict[str, str], tmp_path: Path) -> tuple[subprocess.Popen[str], int]:
    """Starts the page's serve command on 127.0.0.1:0; returns the process and its port."""
    [line] = [t for t in body.splitlines() if t.strip().startswith("shardledger serve")]
    assert DOC_LISTEN in line, line
    port_file = tmp_path / "port"
    command = (
        line.strip()
        .removesuffix("&")
        .replace(DOC_LISTEN, f"--listen 127.0.0.1:0 --port-file {shlex.quote(str(port_file))}")
    )
    proc = subprocess.Popen(
        ["bash", "-c", f"exec {command}"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    for _ in range(600):
        if port_file.exists():
            return proc, int(port_file.read_text())
        if proc.poll() is not None:
            pytest.fail(
                f"serve exited {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}"
            )
        time.sleep(0.05)
    proc.kill()
    pytest.fail("serve wrote no port file")


def test_the_cluster_guide_makes_certificates_and_tokens_that_a_tls_ledger_accepts(
    tmp_path: Path,
) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (.ci/run installs it)")
    env, state = _env(tmp_path), tmp_path / "shell-state.sh"
    server: subprocess.Popen[str] | None = None
    ran = 0
    try:
        for block in blocks(CLUSTER):
            if block.lang not in SHELLS:
                continue
            if block.not_run is not None:
                if "shardledger serve" in block.body:
                    server, port = _serve(block.body, env, tmp_path)
                    env["SHARDLEDGER_SERVER"] = f"localhost:{port}"  # what step 3 sets
                continue
            path = tmp_path / f"block-{block.line}.sh"
            path.write_text(script(block, state))
            proc = subprocess.run(
                ["bash", "--noprofile", "--norc", "-o", "pipefail", str(path)],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            output = proc.stdout + proc.stderr
            assert proc.returncode == 0, f"{block.where()}:\n{block.body}{output}"
            if block.expected is not None:
                missing = missing_lines(block.expected, output)
                assert not missing, f"{block.where()} did not print {missing}:\n{output}"
            ran += 1
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)
    assert server is not None, "the guide's serve block was not found"
    assert ran >= 4
    # What the Slurm step leaves for the jobs: the CA and a token only its owner reads.
    token = Path(env["HOME"]) / ".shardledger" / "token"
    assert token.read_text().startswith("slt_")
    assert token.stat().st_mode & 0o077 == 0
