"""Loopback TCP -> Unix socket forwarder for sandboxes started with `--network none`.

Runs INSIDE the container under its own python3 (stdlib only, no polar_fast import):
    python3 forwarder.py --port PORT --socket /path/to/proxy.sock [--host 127.0.0.1]
Each TCP connection accepted on the container's loopback is piped both ways to a fresh connection
to the mounted Unix socket, where the proxy listens. PORT 0 picks a free port. Once listening it
prints one line `listening HOST:PORT` and flushes, so a caller can wait for that line. A failed
upstream connect closes that one client connection; the forwarder keeps running.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

CHUNK_BYTES = 64 * 1024


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK_BYTES):
            writer.write(data)
            await writer.drain()  # a slow reader slows the other side instead of growing memory
        if writer.can_write_eof():
            writer.write_eof()  # half-close: the peer sees the end of the request/response
    except (ConnectionError, OSError):
        writer.close()


async def _handle(unix_path: str, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
    try:
        upstream_r, upstream_w = await asyncio.open_unix_connection(unix_path)
    except OSError as e:
        print(f"forwarder: cannot connect to {unix_path}: {e}", file=sys.stderr, flush=True)
        client_w.close()
        return
    try:
        await asyncio.gather(_pipe(client_r, upstream_w), _pipe(upstream_r, client_w))
    finally:
        for w in (client_w, upstream_w):
            w.close()


async def serve(host: str, port: int, unix_path: str) -> None:
    server = await asyncio.start_server(lambda r, w: _handle(unix_path, r, w), host, port)
    bound = server.sockets[0].getsockname()
    print(f"listening {bound[0]}:{bound[1]}", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on inside the sandbox")
    parser.add_argument("--port", type=int, required=True, help="TCP port to listen on; 0 = pick one")
    parser.add_argument("--socket", required=True, help="the proxy's Unix socket")
    args = parser.parse_args(argv)
    try:
        asyncio.run(serve(args.host, args.port, args.socket))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
