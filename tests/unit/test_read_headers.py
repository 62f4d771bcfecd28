"""reach reads a header block as nats-py does: held to nats-py's own reader."""

import pytest
from nats.aio.client import Client as NatsConnection

from reach._delivery import read_headers

BLOCKS = [
    b"NATS/1.0\r\n\r\n",
    b"NATS/1.0\r\nReach-Deadline: 1733000000000\r\n\r\n",
    b"NATS/1.0\r\nReach-Deadline: 1\r\nReach-Caller: svc-a\r\nReach-Priority: high\r\n\r\n",
    b"NATS/1.0\r\nName:NoSpace\r\nTabbed:\tvalue\t\r\n\r\n",
    b"NATS/1.0\r\nA: 1\r\nA: 2\r\n\r\n",  # the last one wins
    b"NATS/1.0\r\nno colon here\r\nB: ok\r\n\r\n",
    b"NATS/1.0\r\nBad Name: x\r\nC: ok\r\n\r\n",  # whitespace inside a name
    b"NATS/1.0\r\n\x1cHidden: x\r\nD: ok\r\n\r\n",  # whitespace str.strip would not see
    b"NATS/1.0\r\n\xc3\xa9t\xc3\xa9: x\r\nE: ok\r\n\r\n",  # a name that is not ASCII
    b"NATS/1.0\r\nF: caf\xc3\xa9 \xff\r\n\r\n",  # a value that is not UTF-8
    b"NATS/1.0\r\n: empty name\r\n\r\n",
    b"NATS/1.0\r\nG: a: b: c\r\n\r\n",
    b"NATS/1.0\r\nH:\r\n\r\n",
]


@pytest.mark.parametrize("block", BLOCKS)
def test_a_header_block_is_read_as_nats_py_reads_it(block: bytes):
    expected = NatsConnection._parse_header_lines(block[len(b"NATS/1.0\r\n") :]) or None
    assert read_headers(block) == expected
