"""A TCP proxy that delays every byte by a fixed one-way latency, in both
directions, keeping order (the kernel here has no netem).

    python benchmarks/delay_proxy.py LISTEN_PORT TARGET_HOST:TARGET_PORT DELAY_MS

Data read at time t is written at t + delay; reads are not throttled
(bandwidth is loopback's). benchmarks/bench_pipeline.py puts one in front of
every rank's MLX ring socket.
"""

from __future__ import annotations

import asyncio
import sys
import time


async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    queue: asyncio.Queue = asyncio.Queue()

    async def deliver():
        while True:
            due, data = await queue.get()
            if data is None:
                break
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        writer.close()

    task = asyncio.create_task(deliver())
    try:
        while data := await reader.read(1 << 16):
            queue.put_nowait((time.monotonic() + delay, data))
    except ConnectionError:
        pass
    queue.put_nowait((0.0, None))
    await task


async def main(port: int, target: str, delay_ms: float) -> None:
    host, tport = target.rsplit(":", 1)
    delay = delay_ms / 1000.0

    async def handle(reader, writer):
        for attempt in range(600):  # the target may not listen yet (ranks start at once)
            try:
                up_reader, up_writer = await asyncio.open_connection(host, int(tport))
                break
            except OSError:
                await asyncio.sleep(0.1)
        else:
            writer.close()
            return
        for sock in (writer, up_writer):
            s = sock.get_extra_info("socket")
            if s is not None:
                import socket

                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await asyncio.gather(pump(reader, up_writer, delay), pump(up_reader, writer, delay))

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), sys.argv[2], float(sys.argv[3])))
