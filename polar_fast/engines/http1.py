"""A small keep-alive HTTP/1.1 client for the engine's hot path: POST a JSON body, read the reply.

The proxy makes one engine call per model call, each carrying a whole prompt, so the client's
own CPU per call matters more than its features (aiohttp's client does much we never use).
This speaks what `vllm serve` (uvicorn) and other plain HTTP/1.1 servers answer: replies framed
by Content-Length, chunked, or the end of the connection; keep-alive unless the server says
close. A request on a reused connection that the server had closed while it sat idle (uvicorn
closes them after 5 s) is sent again once on a new connection, as other clients do.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

from polar_fast.errors import PolarError

# The stream's buffer limit: a longer reply head is an error, and a whole reply (vLLM echoes the
# prompt: ~1e5-1e6 bytes) fits below 2x it, so reading never pauses and resumes the socket.
_LIMIT = 4 << 20


class HttpError(PolarError, OSError):
    """The connection failed or the server's reply could not be read as HTTP/1.1. An OSError, so
    callers that catch connection failures (the pools' infra errors, the vllm engine) catch it."""


class Http1Pool:
    def __init__(self, url: str, *, max_idle: int = 256) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"Http1Pool speaks plain http://host[:port], not {url!r}")
        self.host, self.port = parts.hostname, parts.port or 80
        self._base = parts.path.rstrip("/")
        self._host_header = parts.netloc.encode()
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._max_idle = max_idle

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        """(status, reply body). Raises HttpError when no reply could be read."""
        return await self._request(b"POST", path, body, headers)

    async def get(self, path: str, headers: dict[str, str]) -> tuple[int, bytes]:
        """As `post`, for the few GET-only routes (vLLM's /get_world_size)."""
        return await self._request(b"GET", path, b"", headers)

    async def _request(self, method: bytes, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        head = b"".join((
            method, b" ", (self._base + path).encode(), b" HTTP/1.1\r\nHost: ", self._host_header,
            b"\r\nContent-Length: ", str(len(body)).encode(), b"\r\n",
            *(f"{k}: {v}\r\n".encode() for k, v in headers.items()), b"\r\n",
        ))
        while True:
            while self._idle and self._idle[-1][0].at_eof():  # closed by the server while idle
                self._idle.pop()[1].close()
            reused = bool(self._idle)
            reader, writer = self._idle.pop() if reused else await self._connect()
            try:
                writer.writelines((head, body))
                status, keep_alive, reply = await _read_reply(reader)
            except _Stale:
                writer.close()
                if reused:
                    continue  # closed by the server while idle: the request never reached it
                raise HttpError("the server closed the connection without a reply") from None
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as e:
                writer.close()
                raise HttpError(f"{type(e).__name__}: {e}") from None
            except BaseException:  # cancelled or timed out mid-reply: the connection's state is unknown
                writer.close()
                raise
            if keep_alive and len(self._idle) < self._max_idle:
                self._idle.append((reader, writer))
            else:
                writer.close()
            return status, reply

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            return await asyncio.open_connection(self.host, self.port, limit=_LIMIT)
        except OSError as e:
            raise HttpError(f"cannot connect to {self.host}:{self.port}: {e}") from None

    def close(self) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()


class _Stale(PolarError):
    """The connection ended before any byte of the reply."""


async def _read_reply(reader: asyncio.StreamReader) -> tuple[int, bool, bytes]:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            raise _Stale from None
        raise
    except ConnectionResetError:
        raise _Stale from None
    lines = head[:-4].split(b"\r\n")
    version, _, rest = lines[0].partition(b" ")
    if not version.startswith(b"HTTP/1.") or len(rest) < 3 or not rest[:3].isdigit():
        raise ValueError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    status = int(rest[:3])
    length, chunked, keep_alive = None, False, version == b"HTTP/1.1"
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name, value = name.strip().lower(), value.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding":
            chunked = value.endswith(b"chunked")
        elif name == b"connection":
            keep_alive = value == b"keep-alive" or (keep_alive and value != b"close")
    if chunked:
        return status, keep_alive, await _read_chunked(reader)
    if length is not None:
        return status, keep_alive, await reader.readexactly(length)
    if status in (204, 304) or 100 <= status < 200:
        return status, keep_alive, b""
    return status, False, await reader.read()  # framed by the end of the connection


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts = []
    while True:
        size_line = await reader.readuntil(b"\r\n")
        size = int(size_line.split(b";", 1)[0].strip(), 16)
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, then the blank line
                pass
            return b"".join(parts)
        chunk = await reader.readexactly(size + 2)
        if chunk[-2:] != b"\r\n":
            raise ValueError("chunk not followed by CRLF")
        parts.append(chunk[:-2])
