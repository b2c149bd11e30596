"""The agent-path scenarios' pieces that need no pipeline: the S3 proxy that refuses, and what is expected."""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.chaos.agent_scenarios import S3Proxy, expected_samples, plan


def test_each_attempt_expects_one_sample_per_call() -> None:
    tasks = plan(3)
    assert [t["calls"] for t in tasks] == [1, 2, 1]
    want = expected_samples(tasks)
    assert len(want) == 4 * (1 + 2 + 1)
    assert {"t00:0:0", "t01:3:1", "t02:2:0"} <= want and "t00:0:1" not in want


async def test_the_proxy_carries_traffic_refuses_when_closed_and_resets_what_it_carried() -> None:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(100):
            writer.write(data)
            await writer.drain()
        writer.close()

    upstream = await asyncio.start_server(echo, "127.0.0.1", 0)
    port = upstream.sockets[0].getsockname()[1]
    proxy = S3Proxy(f"http://127.0.0.1:{port}")
    try:
        await proxy.open()
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(b"ping")
        assert await asyncio.wait_for(reader.read(100), 5) == b"ping"

        await proxy.close()
        try:  # the carried connection is reset: end of stream, or the reset itself
            assert await asyncio.wait_for(reader.read(100), 5) == b""
        except ConnectionResetError:
            pass
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", proxy.port)

        await proxy.open()  # same port again
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(b"pong")
        assert await asyncio.wait_for(reader.read(100), 5) == b"pong"
        writer.close()
    finally:
        await proxy.close()
        upstream.close()
        await upstream.wait_closed()
