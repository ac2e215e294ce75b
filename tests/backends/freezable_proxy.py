"""A TCP proxy in a process of its own, for a database that stops answering: SIGSTOP it and
every connection through it (open ones and new ones, whose TCP handshake the kernel still
completes) goes silent; SIGCONT it and what the clients sent meanwhile is forwarded late,
as after a network partition heals.

Usage: ``python freezable_proxy.py UPSTREAM_HOST UPSTREAM_PORT [LISTEN_PORT]``; prints the
port it listens on (127.0.0.1; a free one unless given), then serves until killed. Killed and
started again on the same port, it is a dropped connection that comes back, as after a
network blip.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            writer.close()


async def _main(host: str, port: int, listen: int) -> None:
    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(host, port)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(_pipe(client_r, server_w), _pipe(server_r, client_w))

    server = await asyncio.start_server(handle, "127.0.0.1", listen)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) if sys.argv[3:] else 0))
