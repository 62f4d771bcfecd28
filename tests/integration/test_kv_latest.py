"""``_kv.latest`` reads a key the same through nats-py and through the request inbox
(``JsApi.last_msg``, the registry's path): a value, a delete marker, an expiry marker,
no message at all, and no stream."""

import nats
import pytest

from reach import _kv
from reach._jsapi import JsApi
from reach._kv import agents_bucket
from reach._wait import eventually
from reach.testing import unique_prefix


@pytest.fixture
async def both(nats_server):
    nc = await nats.connect(nats_server.url)
    api = JsApi(nc)
    await api.open()
    yield nc.jetstream(), api
    await api.close()
    await nc.close()


async def test_latest_reads_the_same_through_the_inbox_as_through_nats_py(both):
    js, api = both
    bucket = unique_prefix() + "_latest"
    await agents_bucket(js, bucket, create=True)

    async def read(key: str) -> tuple[_kv.Latest, _kv.Latest]:
        return await _kv.latest(js, bucket, key), await _kv.latest(api.last_msg, bucket, key)

    rev = await _kv.write(api.publish, bucket, "a", b'{"x": 1}', last=0, ttl=60)
    assert await read("a") == (_kv.Latest(rev, b'{"x": 1}'),) * 2
    gone = await _kv.delete(api.publish, bucket, "a", last=rev, ttl=60)
    assert await read("a") == (_kv.Latest(gone, None, "DEL"),) * 2
    assert await read("never") == (_kv.Latest(0, None),) * 2
    assert await _kv.latest(api.last_msg, unique_prefix() + "_none", "a") == _kv.Latest(0, None)

    await _kv.write(api.publish, bucket, "b", b"1", last=0, ttl=1)  # the server expires it

    async def expired() -> bool:
        return (await _kv.latest(js, bucket, "b")).operation == "PURGE"

    await eventually(expired, 10.0)
    via_js, via_api = await read("b")
    assert via_js == via_api
    assert via_api.operation == "PURGE"
    assert via_api.value is None
