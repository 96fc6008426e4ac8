"""A slow, lossy TCP link between two hosts: ``python tests/helpers/netns_proxy.py LISTEN UPSTREAM``.

This kernel has no `netem` qdisc, so the link's faults are made here, in userspace:
every chunk read from one side reaches the other ``--delay-ms`` (+ up to
``--jitter-ms``) later, in order; with ``--stall-prob`` a chunk waits ``--stall-ms``
more (a burst of retransmissions); with ``--reset-prob`` (or at every ``--reset-every``-th
chunk) a chunk is not delivered and the connection is reset on both sides (RST: SO_LINGER 0), which is how a lossy
link ends a TCP connection in the end. TCP itself never loses bytes, so a reset
connection is the only loss a client sees. ``--stats FILE`` gets the counts on
each change (connections, resets, stalls, bytes).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import struct
import time
from pathlib import Path
from typing import Any


class Link:
    """The faults of one proxy, and what it did."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.stats = {"connections": 0, "resets": 0, "stalls": 0, "bytes": 0}
        self.chunks = 0
        self.stats_file = Path(args.stats) if args.stats else None

    def save(self) -> None:
        """Writes the counts (atomically) where the test reads them."""
        if self.stats_file is None:
            return
        tmp = self.stats_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.stats))
        os.replace(tmp, self.stats_file)

    def delay_s(self) -> float:
        """Returns how long the next chunk waits on the link."""
        a = self.args
        delay = (float(a.delay_ms) + self.rng.uniform(0, float(a.jitter_ms))) / 1000
        if self.rng.random() < a.stall_prob:
            self.stats["stalls"] += 1
            delay += float(a.stall_ms) / 1000
        return delay


def _reset(writer: asyncio.StreamWriter) -> None:
    sock: Any = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def pump(
    link: Link,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    both: tuple[asyncio.StreamWriter, asyncio.StreamWriter],
) -> None:
    """Carries one direction: each chunk delayed, in order; a reset ends both directions."""
    due = 0.0
    while True:
        chunk = await reader.read(65536)
        if not chunk:
            if not writer.is_closing():
                writer.write_eof()
            return
        link.chunks += 1
        every = link.args.reset_every
        if link.rng.random() < link.args.reset_prob or (every and link.chunks % every == 0):
            link.stats["resets"] += 1
            link.save()
            for w in both:
                _reset(w)
            return
        due = max(due, time.monotonic() + link.delay_s())
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        if writer.is_closing():
            return
        writer.write(chunk)
        link.stats["bytes"] += len(chunk)
        await writer.drain()


async def serve(link: Link) -> None:
    """Accepts connections on the listen address and carries each to the upstream."""
    up_host, up_port = link.args.upstream.rsplit(":", 1)

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(up_host, int(up_port))
        except OSError:
            _reset(client_w)
            return
        link.stats["connections"] += 1
        link.save()
        both = (client_w, up_w)
        try:
            await asyncio.gather(pump(link, client_r, up_w, both), pump(link, up_r, client_w, both))
        except (OSError, asyncio.IncompleteReadError):
            for w in both:
                _reset(w)
        finally:
            for w in both:
                w.close()

    host, port = link.args.listen.rsplit(":", 1)
    server = await asyncio.start_server(handle, host, int(port), reuse_address=True)
    link.save()
    async with server:
        await server.serve_forever()


def main() -> int:
    """Runs the proxy until killed."""
    parser = argparse.ArgumentParser()
    parser.add_argument("listen")
    parser.add_argument("upstream")
    parser.add_argument("--delay-ms", type=float, default=40)
    parser.add_argument("--jitter-ms", type=float, default=40)
    parser.add_argument("--stall-prob", type=float, default=0.02)
    parser.add_argument("--stall-ms", type=float, default=800)
    parser.add_argument("--reset-prob", type=float, default=0.01)
    parser.add_argument("--reset-every", type=int, default=0, help="also reset at every Nth chunk")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stats", default="")
    asyncio.run(serve(Link(parser.parse_args())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
