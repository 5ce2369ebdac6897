"""A TCP forwarder for the multi-host tests: listens on an address of the test
network's bridge and forwards each connection to the same port on this host's
loopback (where PostgreSQL and Redis listen), so that the hosts in network
namespaces reach them. Runs until its standard input closes (the test that
started it is gone).

    python forward.py LISTEN_HOST PORT [PORT...]
"""

import asyncio
import os
import sys


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def forward_to(port: int, reader, writer) -> None:
    try:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        writer.close()
        return
    await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


async def main(host: str, ports: list[int]) -> None:
    servers = [  # noqa: F841 - kept open until the process ends
        await asyncio.start_server(
            lambda r, w, port=port: forward_to(port, r, w), host, port
        )
        for port in ports
    ]
    print("forwarding", flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)  # until the parent is gone
    os._exit(0)  # the connections still open end with the process


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], [int(port) for port in sys.argv[2:]]))
