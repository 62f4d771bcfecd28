"""PROTOCOL.md 3.3 from the spec alone, in another language: ``stream_consumer.mjs``, a
plain nats.js client (the official ``@nats-io/transport-node``, no Reach code), consumes a
stream from a reach agent: the request with ``Reach-Stream-Window``, the opened frame,
credit as it reads (more chunks than one window: without credit the stream would stall),
chunks in order, the end frame."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec

from reach import Agent
from reach.settings import ReachSettings
from tests.tools import need_npm

HERE = Path(__file__).parent
PACKAGE = "@nats-io/transport-node"
INSTALL = "npm ci --prefix tests/interop"


class Prompt(msgspec.Struct):
    n: int


class Token(msgspec.Struct):
    i: int
    text: str


async def test_a_nats_js_client_consumes_a_stream_from_the_spec_alone(
    reach_settings: ReachSettings,
) -> None:
    node = need_npm(PACKAGE, HERE, INSTALL)
    n, window = 25, 4
    calls: list[int] = []
    agent = Agent("llm", "llm-js", settings=reach_settings)

    @agent.capability("chat.complete")
    async def complete(req: Prompt) -> AsyncIterator[Token]:
        calls.append(req.n)
        for i in range(req.n):
            yield Token(i=i, text=f"t{i}")

    async with agent:
        proc = await asyncio.create_subprocess_exec(
            node,
            str(HERE / "stream_consumer.mjs"),
            reach_settings.nats_url,
            "chat.complete",
            json.dumps({"n": n}),
            str(window),
            reach_settings.subject_prefix,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            async with asyncio.timeout(60):
                out, err = await proc.communicate()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    assert proc.returncode == 0, err.decode()
    chunks = [json.loads(line) for line in out.decode().splitlines()]
    assert chunks == [{"i": i, "text": f"t{i}"} for i in range(n)]
    assert calls == [n]  # the handler ran once
    assert err.decode().splitlines()[-1] == f"end: {n} chunk(s)"
