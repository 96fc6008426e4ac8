"""One ledger server replica for the tests: ``python tests/helpers/pg_replica.py URL PORT_FILE KEY``.

Serves the database at URL on 127.0.0.1 with an ephemeral port, writes the port
to PORT_FILE once serving, and signs tree heads with KEY (shared by every replica).
"""

from __future__ import annotations

import os
import sys

from ledger_server.config import ServerConfig
from ledger_server.server import configure_logging, serve


def main(argv: list[str]) -> int:
    """Serves until SIGTERM."""
    url, port_file, key = argv

    def ready(port: int) -> None:
        with open(port_file + ".tmp", "w") as fh:
            fh.write(str(port))
        os.replace(port_file + ".tmp", port_file)

    configure_logging("warning")
    config = ServerConfig(database=url, listen="127.0.0.1:0", signing_key=key, grace_s=2.0)
    return serve(config, ready=ready)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
