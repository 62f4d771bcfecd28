"""The gateway's transport wrapper: a response's writes made in one turn of the loop leave
as one write, in order; a close or a large amount held writes at once."""

import asyncio

from reach._gateway.serving import HOLD_LIMIT, JoinedWrites


class Recorded:
    """The transport calls the wrapper passes on."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bytes]] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.calls.append(("write", data))

    def close(self) -> None:
        self.closing = True
        self.calls.append(("close", b""))

    def is_closing(self) -> bool:
        return self.closing

    def get_extra_info(self, name: str) -> str:
        return f"info:{name}"


async def turn() -> None:
    """Until the callbacks scheduled so far have run (they run in order: ours is last)."""
    done = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_soon(done.set_result, None)
    await done


async def test_writes_of_one_turn_leave_as_one():
    raw = Recorded()
    joined = JoinedWrites(raw, asyncio.get_running_loop())  # type: ignore[arg-type]
    joined.write(b"HTTP/1.1 200 OK\r\n\r\n")
    joined.write(memoryview(b"body"))
    assert raw.calls == []
    await turn()
    assert raw.calls == [("write", b"HTTP/1.1 200 OK\r\n\r\nbody")]
    joined.write(b"next")
    await turn()
    assert raw.calls[-1] == ("write", b"next")
    assert joined.get_extra_info("peername") == "info:peername"


async def test_a_close_writes_what_is_held_first():
    raw = Recorded()
    joined = JoinedWrites(raw, asyncio.get_running_loop())  # type: ignore[arg-type]
    joined.write(b"last words")
    joined.close()
    await turn()
    assert raw.calls == [("write", b"last words"), ("close", b"")]


async def test_holding_more_than_the_limit_writes_at_once():
    raw = Recorded()
    joined = JoinedWrites(raw, asyncio.get_running_loop())  # type: ignore[arg-type]
    big = b"x" * (HOLD_LIMIT // 2 + 1)
    joined.write(big)
    assert raw.calls == []
    joined.write(big)
    assert raw.calls == [("write", big + big)]  # the transport's flow control sees it now
    await turn()
    assert len(raw.calls) == 1


async def test_every_way_to_write_keeps_the_order_and_the_count():
    raw = Recorded()
    raw.write_eof = lambda: raw.calls.append(("eof", b""))  # type: ignore[method-assign]
    raw.abort = lambda: raw.calls.append(("abort", b""))  # type: ignore[method-assign]
    raw.get_write_buffer_size = lambda: 7  # type: ignore[method-assign]
    joined = JoinedWrites(raw, asyncio.get_running_loop())  # type: ignore[arg-type]
    joined.write(b"a")
    joined.writelines([b"b", memoryview(b"c")])
    assert joined.get_write_buffer_size() == 3 + 7  # held here, and held by the transport
    joined.write_eof()
    assert raw.calls == [("write", b"abc"), ("eof", b"")]
    joined.write(b"dropped")
    joined.abort()
    await turn()
    assert raw.calls[-1] == ("abort", b"")
    assert ("write", b"dropped") not in raw.calls
