"""The HTTP wrapper against a real HTTP service and a real nats-server: results, the error
mapping, and what the wrapped service is told (deadline, ids, trace context)."""

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

import reach
from reach import Client, Priority, Telemetry
from reach._codec import now_ms
from reach._wrap import HttpWrapper
from reach._wrap.forward import SNIPPET
from reach.testing import eventually

from .wrap_upstream import free_port, serve_raw, serve_upstream, spec


@pytest.fixture
async def upstream():
    async with serve_upstream() as up:
        yield up


def wrapper(settings, *endpoints, **kw) -> HttpWrapper:
    return HttpWrapper(spec(*endpoints, **kw), settings=settings)


async def test_json_in_json_out_served_by_the_wrapper(reach_settings, reach_client, upstream):
    w = wrapper(reach_settings, {"capability": "t.echo", "url": upstream.url("/echo")})
    async with w:
        reply = await reach_client.call("t.echo", {"q": "hi", "n": [1, 2]}, timeout=10)
    assert reply.value == {"got": {"q": "hi", "n": [1, 2]}}
    assert reply.agent_id == w.agent.agent_id
    seen = upstream.last("/echo")
    assert seen.method == "POST"
    assert seen.headers["content-type"] == "application/json"
    assert w.stats.forwarded == w.stats.ok == 1


async def test_method_and_query_parameters(reach_settings, reach_client, upstream):
    w = wrapper(
        reach_settings,
        {"capability": "t.put", "url": upstream.url("/echo"), "method": "put"},
        {"capability": "t.get", "url": upstream.url("/query?fixed=1"), "method": "GET"},
    )
    async with w:
        assert await reach_client.request("t.put", [1], timeout=10) == {"got": [1]}
        got = await reach_client.request("t.get", {"q": "a b", "n": 2, "ok": True}, timeout=10)
        assert got == {"fixed": "1", "q": "a b", "n": "2", "ok": "true"}
        assert await reach_client.request("t.get", None, timeout=10) == {"fixed": "1"}
        with pytest.raises(reach.BadRequest, match="JSON object of query parameters"):
            await reach_client.request("t.get", [1, 2], timeout=10)
        # The URL's own parameters (an API key, say) are not the caller's to change.
        with pytest.raises(reach.BadRequest, match="query parameter 'fixed' is set by"):
            await reach_client.request("t.get", {"fixed": "2", "q": 1}, timeout=10)
    assert upstream.last("/echo").method == "PUT"
    assert upstream.last("/query").query == {"fixed": "1"}  # the refused one was not sent


async def test_text_answers_are_strings_and_empty_ones_null(reach_settings, reach_client, upstream):
    w = wrapper(
        reach_settings,
        {"capability": "t.text", "url": upstream.url("/text")},
        {"capability": "t.empty", "url": upstream.url("/empty")},
    )
    async with w:
        assert await reach_client.request("t.text", {}, timeout=10) == "plain words"
        assert await reach_client.request("t.empty", {}, timeout=10) is None
    assert upstream.last("/empty").body == b"{}"


@pytest.mark.parametrize(
    ("status", "error", "code"),
    [
        (400, reach.BadRequest, "bad_request"),
        (404, reach.BadRequest, "bad_request"),
        (408, reach.RequestTimeout, "timeout"),
        (422, reach.BadRequest, "bad_request"),
        (429, reach.ResourceExhausted, "resource_exhausted"),
        (503, reach.ResourceExhausted, "resource_exhausted"),
        (500, reach.HandlerFailed, "failed"),
        (502, reach.HandlerFailed, "failed"),
        (504, reach.RequestTimeout, "timeout"),
    ],
)
async def test_http_errors_map_to_reach_codes(
    reach_settings, reach_client, upstream, status, error, code
):
    w = wrapper(reach_settings, {"capability": "t.err", "url": upstream.url(f"/status/{status}")})
    async with w:
        with pytest.raises(error) as info:
            await reach_client.request("t.err", {}, timeout=10, max_attempts=1)
    assert info.value.code == code
    assert f"upstream HTTP {status}" in info.value.message
    assert f"nope {status}" in info.value.message  # the body's first bytes
    assert w.stats.http_errors == {status: 1}


async def test_a_long_error_body_is_cut_short(reach_settings, reach_client, upstream):
    w = wrapper(
        reach_settings, {"capability": "t.big", "url": upstream.url("/status/400?size=9000")}
    )
    async with w:
        with pytest.raises(reach.BadRequest) as info:
            await reach_client.request("t.big", {}, timeout=10)
    quoted = info.value.message.split("upstream HTTP 400: ", 1)[1]
    assert quoted.startswith('{"detail":"xxx')
    assert len(quoted) == SNIPPET


async def test_no_answer_within_the_endpoint_timeout_is_a_timeout(
    reach_settings, reach_client, upstream
):
    w = wrapper(
        reach_settings, {"capability": "t.slow", "url": upstream.url("/hold"), "timeout": 0.3}
    )
    async with w:
        with pytest.raises(reach.RequestTimeout, match=r"upstream gave no answer within 0\.3s"):
            await reach_client.request("t.slow", {}, timeout=30, max_attempts=1)
    assert w.stats.timeouts == 1
    assert upstream.last("/hold").headers["reach-timeout-ms"] == "300"


async def test_the_callers_shorter_deadline_bounds_the_http_call(
    reach_settings, reach_client, upstream
):
    w = wrapper(
        reach_settings, {"capability": "t.slow", "url": upstream.url("/hold"), "timeout": 60}
    )
    async with w:
        with pytest.raises(reach.RequestTimeout):
            await reach_client.request("t.slow", {}, timeout=0.5, max_attempts=1)
        await eventually(lambda: w.stats.timeouts == 1)
    assert int(upstream.last("/hold").headers["reach-timeout-ms"]) <= 500


async def test_an_answer_over_max_body_is_failed_and_not_read_further(
    reach_settings, reach_client, upstream
):
    w = wrapper(
        reach_settings,
        {"capability": "t.fits", "url": upstream.url("/big?size=1000")},
        {"capability": "t.big", "url": upstream.url("/big?size=5000")},
        max_body=1000,
    )
    async with w:
        assert await reach_client.request("t.fits", {}, timeout=10) == "x" * 998
        with pytest.raises(reach.HandlerFailed, match="upstream answer over 1000 bytes"):
            await reach_client.request("t.big", {}, timeout=10)
    assert w.stats.too_large == 1


async def test_max_body_defaults_to_max_payload_and_counts_decompressed_bytes(
    reach_settings, reach_client, upstream
):
    url = upstream.url("/big?gzip=1&size=3000000")  # ~3 MB of x, a few kB on the wire
    w = wrapper(reach_settings, {"capability": "t.bomb", "url": url})
    async with w:
        limit = w.agent.client.nc.max_payload
        with pytest.raises(reach.HandlerFailed, match=f"upstream answer over {limit} bytes"):
            await reach_client.request("t.bomb", {}, timeout=10)


@pytest.mark.parametrize(
    "answer",
    [
        b"",  # the connection closed with no answer at all
        b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"a"',
    ],
    ids=["no-answer", "cut-short-body"],
)
async def test_a_connection_broken_after_sending_is_failed(reach_settings, reach_client, answer):
    async with serve_raw(answer) as port:
        w = wrapper(reach_settings, {"capability": "t.cut", "url": f"http://127.0.0.1:{port}/"})
        async with w:
            with pytest.raises(reach.HandlerFailed, match="upstream exchange failed"):
                await reach_client.request("t.cut", {}, timeout=10, max_attempts=1)
    assert w.stats.broken == 1


async def test_an_unreachable_endpoint_is_agent_unavailable(reach_settings, reach_client):
    w = wrapper(reach_settings, {"capability": "t.gone", "url": f"http://127.0.0.1:{free_port()}/"})
    async with w:
        with pytest.raises(reach.AgentUnavailable) as info:
            await reach_client.request("t.gone", {}, timeout=10, max_attempts=1)
    assert "upstream unreachable (ConnectError)" in info.value.message
    assert w.stats.unreachable == 1


async def test_deadline_ids_idempotency_key_and_trace_context_are_forwarded(
    reach_settings, reach_client, upstream
):
    w = wrapper(
        reach_settings,
        {
            "capability": "t.ask",
            "url": upstream.url("/echo"),
            "timeout": 5,
            "headers": {"Authorization": "Bearer k", "X-Tenant": "t1"},
        },
    )
    trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    async with w:
        deadline = now_ms() + 3000
        msg = await reach_client.nc.request(
            reach_client.subjects.cap("t.ask"),
            b'{"q": 1}',
            headers={
                "Reach-Deadline": str(deadline),
                "Reach-Request-Id": "req-42",
                "Reach-Idempotency-Key": "idem-7",
                "Reach-Priority": "high",
                "Reach-Attempt": "2",
                "traceparent": trace,
                "tracestate": "vendor=1",
            },
            timeout=10,
        )
        assert msg.data == b'{"got":{"q":1}}'
        # A far deadline: the endpoint's own timeout is what the service is told.
        far = now_ms() + 600_000
        await reach_client.nc.request(
            reach_client.subjects.cap("t.ask"), b"{}", headers={"Reach-Deadline": str(far)}
        )
    first, second = [s.headers for s in upstream.seen]
    assert first["reach-deadline"] == str(deadline)  # the caller's own, to the millisecond
    assert 0 < int(first["reach-timeout-ms"]) <= 3000
    assert first["reach-request-id"] == "req-42"
    assert first["idempotency-key"] == "idem-7"
    assert first["reach-priority"] == "high"
    assert first["traceparent"] == trace
    assert first["tracestate"] == "vendor=1"
    assert first["reach-attempt"] == "2"
    assert first["authorization"] == "Bearer k"
    assert first["x-tenant"] == "t1"
    assert int(second["reach-deadline"]) < far
    assert int(second["reach-timeout-ms"]) == 5000
    assert "idempotency-key" not in second
    assert "traceparent" not in second
    assert second["reach-attempt"] == "1"
    assert second["reach-request-id"]  # the protocol's default: from the reply subject


@pytest.mark.parametrize(
    ("headers", "said"),
    [
        ({"reach-request-id": "x"}, "set by Reach"),
        ({"REACH-DEADLINE": "1"}, "set by Reach"),
        ({"Content-Type": "text/plain"}, "set by Reach"),
        ({"idempotency-key": "k"}, "set by Reach"),
        ({"Traceparent": "00-x"}, "set by Reach"),
        ({"Host": "elsewhere"}, "set by Reach"),
        ({"X Bad": "v"}, "not a valid header name"),
        ({"": "v"}, "not a valid header name"),
        ({"X-Ok": "line\r\nInjected: 1"}, "control characters"),
    ],
)
def test_reserved_or_malformed_endpoint_headers_are_refused(headers, said):
    ep = {"capability": "t.h", "url": "http://127.0.0.1:9/", "headers": headers}
    with pytest.raises(reach.ConfigurationError, match=said):
        spec(ep)


async def test_with_a_tracer_the_service_continues_the_handlers_span(reach_settings, upstream):
    provider = TracerProvider()
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry = Telemetry(tracer_provider=provider)
    w = HttpWrapper(
        spec({"capability": "t.traced", "url": upstream.url("/echo")}),
        settings=reach_settings,
        telemetry=telemetry,
    )
    async with w, Client(settings=reach_settings, telemetry=telemetry) as client:
        await client.request("t.traced", {}, timeout=10, priority=Priority.NORMAL)
    server = next(s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER)
    ctx = server.get_span_context()
    version, trace_id, parent_id, _flags = upstream.last("/echo").headers["traceparent"].split("-")
    assert version == "00"
    assert int(trace_id, 16) == ctx.trace_id
    assert int(parent_id, 16) == ctx.span_id  # the HTTP call is the handler span's child


async def test_no_time_left_is_a_timeout_without_calling_the_endpoint(reach_client, upstream):
    import httpx

    from reach._wrap.forward import Forwarder, WrapStats

    ep = spec({"capability": "t.late", "url": upstream.url("/echo")}).endpoints[0]
    ctx = reach.Context(
        agent_id="a-1",
        client=reach_client,
        capability="t.late",
        request_id="r-1",
        priority=Priority.NORMAL,
        deadline_ms=now_ms() - 1,
        caller="",
        attempt=1,
    )
    async with httpx.AsyncClient() as http:
        fwd = Forwarder(http, WrapStats(), max_body=1000)
        with pytest.raises(reach.RequestTimeout, match="no time left"):
            await fwd(ep, b"{}", ctx)
    assert upstream.seen == []
    assert fwd.stats.timeouts == 1


async def test_proxy_variables_do_not_reroute_wrapped_traffic(
    reach_settings, reach_client, upstream, monkeypatch
):
    dead = f"http://127.0.0.1:{free_port()}"
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, dead)
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    w = wrapper(reach_settings, {"capability": "t.direct", "url": upstream.url("/echo")})
    async with w:
        assert await reach_client.request("t.direct", 1, timeout=10) == {"got": 1}


def test_redact_drops_userinfo_and_query():
    from reach._wrap import redact

    assert redact("http://u:pw@h.example:8080/a/b?api_key=s&x=1#f") == "http://h.example:8080/a/b?…"
    assert redact("https://h.example/ask") == "https://h.example/ask"
    assert redact("http://[::1]:9/") == "http://[::1]:9/"


async def test_logs_show_no_credentials_of_the_endpoint_url(reach_settings, reach_client, caplog):
    url = f"http://user:pw-s3cret@127.0.0.1:{free_port()}/ask?api_key=k-s3cret"
    w = wrapper(reach_settings, {"capability": "t.secret", "url": url})
    with caplog.at_level("INFO", logger="reach.wrap"):
        async with w:
            with pytest.raises(reach.AgentUnavailable):
                await reach_client.request("t.secret", {}, timeout=10, max_attempts=1)
    said = "\n".join(r.getMessage() for r in caplog.records if r.name == "reach.wrap")
    assert "t.secret -> POST http://127.0.0.1:" in said
    assert "unreachable" in said
    assert "s3cret" not in said


async def test_warnings_about_a_down_upstream_are_rate_limited(reach_client, caplog):
    import httpx

    from reach._wrap.forward import Forwarder, Throttle, WrapStats

    ep = spec({"capability": "t.down", "url": f"http://127.0.0.1:{free_port()}/"}).endpoints[0]
    ctx = reach.Context(
        agent_id="a-1",
        client=reach_client,
        capability="t.down",
        request_id="r-1",
        priority=Priority.NORMAL,
        deadline_ms=None,
        caller="",
        attempt=1,
    )
    now = [100.0]
    async with httpx.AsyncClient() as http:
        fwd = Forwarder(http, WrapStats(), 1000, Throttle(every=30.0, clock=lambda: now[0]))
        with caplog.at_level("WARNING", logger="reach.wrap"):
            for _ in range(5):
                with pytest.raises(reach.AgentUnavailable):
                    await fwd(ep, b"{}", ctx)
            now[0] += 31
            with pytest.raises(reach.AgentUnavailable):
                await fwd(ep, b"{}", ctx)
    said = [r.getMessage() for r in caplog.records if r.name == "reach.wrap"]
    assert len(said) == 2
    assert "unreachable" in said[0]
    assert "4 more like it since the last" in said[1]
    assert fwd.stats.unreachable == 6
