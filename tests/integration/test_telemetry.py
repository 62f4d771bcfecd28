"""Telemetry end to end: metrics by outcome read from the passed-in registry, one trace
across client, agent, nested call, durable task and callback, no spans when off, JSON logs
with ids, and /metrics and /healthz served by agents and registries."""

import asyncio
import logging

import msgspec
import pytest
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import ProxyTracerProvider, SpanKind
from prometheus_client import CollectorRegistry

import reach
from reach import Agent, Client, Registry, Telemetry
from reach.telemetry import IdsFilter, JsonFormatter
from reach.testing import eventually

from ..tools import need
from .registry_wire import fast_settings


class Busy(reach.RemoteError):
    code = "busy_now"


@pytest.fixture
def settings(nats_server):
    return fast_settings(nats_server.url)


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def echo_agent(settings, telemetry: Telemetry, agent_id: str = "tel-1", **kw) -> Agent:
    agent = Agent("tel", agent_id, settings=settings, telemetry=telemetry, **kw)

    @agent.capability("tel.echo")
    async def echo(req: dict) -> dict:
        if req.get("refuse"):
            raise Busy("not now")
        if req.get("fail"):
            raise RuntimeError("boom")
        return req

    return agent


async def test_metrics_carry_the_outcome_of_each_request(settings):
    registry = CollectorRegistry()
    telemetry = Telemetry(registry)
    async with (
        Registry(settings=settings, telemetry=telemetry),
        echo_agent(settings, telemetry),
        Client(settings=settings, telemetry=telemetry) as client,
    ):
        await eventually(lambda: _has(client, "tel.echo"), timeout=15)
        for _ in range(3):
            await client.request("tel.echo", {"n": 1})
        with pytest.raises(reach.HandlerFailed):
            await client.request("tel.echo", {"refuse": True})
        with pytest.raises(reach.HandlerFailed):
            await client.request("tel.echo", {"fail": True})
        with pytest.raises(reach.BadRequest):
            await client.request("tel.echo", [1, 2])
        await client.request("tel.echo", {"n": 1}, priority="high")
        refused = await client.nc.request(
            client.subjects.cap("tel.echo"), b"{}", headers={"Reach-Priority": "urgent"}
        )
        assert refused.headers["Nats-Service-Error-Code"] == "400"
        rejected = "reach_agent_requests_rejected_total"
        assert sample(registry, rejected, agent="tel", reason="bad_header") == 1

        c = "reach_client_requests_total"
        assert sample(registry, c, capability="tel.echo", policy="balanced", outcome="ok") == 4
        assert sample(registry, c, capability="tel.echo", policy="balanced", outcome="refused") == 1
        assert sample(registry, c, capability="tel.echo", policy="balanced", outcome="failed") == 1
        assert (
            sample(registry, c, capability="tel.echo", policy="balanced", outcome="bad_request")
            == 1
        )
        lat = "reach_client_request_duration_seconds_count"
        assert sample(registry, lat, capability="tel.echo") == 7
        assert sample(registry, "reach_client_requests_in_flight", capability="tel.echo") == 0
        attempts = "reach_client_attempts_total"
        assert sample(registry, attempts, capability="tel.echo", outcome="ok") == 4

        a = "reach_agent_requests_total"
        labels = {"agent": "tel", "capability": "tel.echo"}
        assert sample(registry, a, **labels, priority="normal", outcome="ok") == 3
        assert sample(registry, a, **labels, priority="high", outcome="ok") == 1
        assert sample(registry, a, **labels, priority="normal", outcome="refused") == 1
        assert sample(registry, a, **labels, priority="normal", outcome="failed") == 1
        assert sample(registry, a, **labels, priority="normal", outcome="bad_request") == 1
        handled = "reach_agent_handler_duration_seconds_count"
        assert sample(registry, handled, **labels) == 4
        assert sample(registry, "reach_agent_info", agent="tel", agent_id="tel-1", status="UP") == 1
        assert sample(registry, "reach_agent_queue_length", agent="tel", priority="high") == 0

        up = "reach_registry_agents"
        assert sample(registry, up, capability="tel.echo", status="UP") == 1
        assert (
            sample(registry, "reach_registry_transitions_total", status="UP", reason="registered")
            >= 1
        )
        assert sample(registry, "reach_registry_heartbeats_total") >= 1
        assert sample(registry, "reach_registry_heartbeat_lag_seconds_count") >= 1


async def test_retries_and_failovers_are_counted(settings):
    """An instance that hangs, called with work that may run twice (idempotent): each
    timeout, cut short to leave the faster instance time, is retried on it."""
    registry = CollectorRegistry()
    telemetry = Telemetry(registry)
    slow = Agent("tel", "tel-slow", settings=settings)
    release = asyncio.Event()

    @slow.capability("tel.work")
    async def hang(req: dict) -> dict:
        if req.get("warm"):
            await asyncio.sleep(0.05)  # the work: slower than tel-fast's
            return {}
        await release.wait()
        return {}

    fast = Agent("tel", "tel-fast", settings=settings)

    @fast.capability("tel.work")
    async def work(req: dict) -> dict:
        return {}

    try:
        async with (
            Registry(settings=settings),
            slow,
            fast,
            Client(settings=settings, telemetry=telemetry) as client,
        ):
            await eventually(lambda: _has(client, "tel.work", 2), timeout=15)
            # the client learns both latencies (a reserve is kept only for a faster one)
            await client.request("tel.work", {"warm": True}, agent_id="tel-fast")
            name = "reach_client_attempts_total"

            def timeouts() -> float:
                return sample(registry, name, capability="tel.work", outcome="timeout")

            for _ in range(2):
                # the session sticks to tel-slow, which then hangs: the attempt is cut
                # short, times out and is retried on tel-fast (the session moves there)
                await client.request(
                    "tel.work", {"warm": True}, agent_id="tel-slow", affinity_key="s"
                )
                await client.request(
                    "tel.work",
                    {},
                    timeout=2,
                    routing="affinity",
                    affinity_key="s",
                    idempotent=True,
                )
            sent = 2
            assert timeouts() >= 2
            assert sample(registry, name, capability="tel.work", outcome="ok") == sent + 3
            retries = sample(registry, "reach_client_retries_total", capability="tel.work")
            assert retries == timeouts()  # each timeout was retried, none refused
            assert (
                sample(registry, "reach_client_failovers_total", capability="tel.work") == retries
            )
            ok = sample(
                registry,
                "reach_client_requests_total",
                capability="tel.work",
                policy="affinity",
                outcome="ok",
            )
            assert ok == sent
    finally:
        release.set()


async def _has(client: Client, capability: str, n: int = 1) -> bool:
    records = await client.agents(capability)
    return sum(r.status is reach.Status.UP for r in records) >= n


class Counting(SpanProcessor):
    """Counts spans started, exported or not."""

    def __init__(self) -> None:
        self.started = 0

    def on_start(self, span, parent_context=None) -> None:
        self.started += 1


def tracing() -> tuple[TracerProvider, InMemorySpanExporter, Counting]:
    provider = TracerProvider()
    exporter = InMemorySpanExporter()
    counting = Counting()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    provider.add_span_processor(counting)
    return provider, exporter, counting


async def test_one_trace_links_client_agent_nested_call_task_and_callback(settings):
    provider, exporter, _ = tracing()
    telemetry = Telemetry(tracer_provider=provider)
    front = Agent("front", "front-1", settings=settings, telemetry=telemetry)
    back = Agent("back", "back-1", settings=settings, telemetry=telemetry)
    callbacks: list = []

    @front.capability("tel.front")
    async def handle(req: dict, ctx: reach.Context) -> dict:
        inner = await ctx.client.request("tel.back", req)
        ref = await ctx.client.submit("tel.job", req, callback=req["callback"])
        return {"inner": inner, "task": ref.task_id}

    @back.capability("tel.back")
    async def inner(req: dict) -> dict:
        return {"ok": True}

    @back.task("tel.job")
    async def job(req: dict) -> dict:
        return {"done": True}

    async with (
        Registry(settings=settings),
        front,
        back,
        Client(settings=settings, telemetry=telemetry) as client,
    ):
        got = asyncio.Event()

        async def on_callback(msg) -> None:
            callbacks.append(msg)
            await msg.respond(b"")
            got.set()

        callback = f"{settings.subject_prefix}.callbacks.tel"
        await client.nc.subscribe(callback, cb=on_callback)
        await client.flush()
        await eventually(lambda: _has(client, "tel.back"), timeout=15)
        await eventually(lambda: _has(client, "tel.front"), timeout=15)
        tracer = provider.get_tracer("test")
        with tracer.start_as_current_span("user request") as root:
            out = await client.request("tel.front", {"callback": callback})
        ref = await client.task(out["task"])
        assert (await ref.result(timeout=30)) == {"done": True}
        async with asyncio.timeout(30):
            await got.wait()

        def spans() -> list[ReadableSpan]:
            return list(exporter.get_finished_spans())

        await eventually(lambda: any(s.name == "process tel.job" for s in spans()))
        trace_id = root.get_span_context().trace_id
        by_name = {s.name: s for s in spans() if s.context.trace_id == trace_id}
        sent = by_name["send tel.front"]
        assert sent.kind is SpanKind.CLIENT
        assert sent.parent.span_id == root.get_span_context().span_id
        assert sent.attributes["messaging.system"] == "nats"
        assert sent.attributes["reach.capability"] == "tel.front"
        assert sent.attributes["reach.outcome"] == "ok"
        assert sent.attributes["reach.routing_policy"] == "balanced"
        served = by_name["process tel.front"]
        assert served.kind is SpanKind.SERVER
        assert served.parent.span_id == sent.context.span_id
        assert served.attributes["reach.agent_id"] == "front-1"
        nested = by_name["send tel.back"]
        assert nested.parent.span_id == served.context.span_id
        assert by_name["process tel.back"].parent.span_id == nested.context.span_id
        submit = by_name["send tel.job"]
        assert submit.kind is SpanKind.PRODUCER
        assert submit.parent.span_id == served.context.span_id
        attempt = by_name["process tel.job"]
        assert attempt.kind is SpanKind.CONSUMER
        assert attempt.parent.span_id == submit.context.span_id
        assert attempt.attributes["reach.attempt"] == 1
        # the callback request carries the attempt's context
        header = callbacks[0].headers["traceparent"]
        assert header.split("-")[1] == format(trace_id, "032x")
        assert header.split("-")[2] == format(attempt.context.span_id, "016x")


async def test_telemetry_off_creates_no_span_objects(settings):
    """A provider exists, but this telemetry has tracing off: nothing starts a span, on the
    request path, in handlers or for tasks; and no provider at all means no tracer."""
    provider, exporter, counting = tracing()
    assert Telemetry(tracer_provider=ProxyTracerProvider()).tracer is None  # none configured
    off = Telemetry(tracer_provider=provider, tracing=False)
    agent = echo_agent(settings, off)

    @agent.task("tel.quiet")
    async def quiet(req: dict) -> dict:
        return req

    async with (
        Registry(settings=settings),
        agent,
        Client(settings=settings, telemetry=off) as client,
    ):
        await eventually(lambda: _has(client, "tel.echo"), timeout=15)
        for _ in range(20):
            await client.request("tel.echo", {"n": 1})
        ref = await client.submit("tel.quiet", {"n": 1})
        assert await ref.result(timeout=30) == {"n": 1}
    assert counting.started == 0
    assert exporter.get_finished_spans() == ()


async def test_json_logs_carry_request_agent_and_trace_ids(settings):
    provider, _, _ = tracing()
    telemetry = Telemetry(tracer_provider=provider)
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(self.format(record))

    keep = Keep()
    keep.addFilter(IdsFilter())
    keep.setFormatter(JsonFormatter())
    log = logging.getLogger("tel.handler")
    log.addHandler(keep)
    log.setLevel(logging.INFO)
    agent = Agent("tel", "tel-logs", settings=settings, telemetry=telemetry)

    @agent.capability("tel.log")
    async def logs(req: dict) -> dict:
        log.info("working on it")
        return {}

    try:
        async with agent, Client(settings=settings, telemetry=telemetry) as client:
            reply = await client.call("tel.log", {}, agent_id="tel-logs", request_id="req-42")
            assert reply.request_id == "req-42"
    finally:
        log.removeHandler(keep)
    record = msgspec.json.decode(lines[0])
    assert record["message"] == "working on it"
    assert record["agent_id"] == "tel-logs"
    assert record["request_id"] == "req-42"
    assert len(record["trace_id"]) == 32
    assert record["level"] == "INFO"


async def http_get(url: str, path: str) -> tuple[int, str]:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    data = await reader.read()
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode()


async def test_agents_and_registries_serve_metrics_and_health(settings):
    async with (
        Registry(settings=settings, metrics_port=0) as registry,
        echo_agent(settings, Telemetry(), metrics_port=0) as agent,
        Client(settings=settings) as client,
    ):
        await eventually(lambda: _has(client, "tel.echo"), timeout=15)
        await client.request("tel.echo", {"n": 1})
        with pytest.raises(reach.HandlerFailed):
            await client.request("tel.echo", {"fail": True})
        ref_client = client.telemetry.exposition().decode()
        assert agent.metrics_url
        assert registry.metrics_url
        status, text = await http_get(agent.metrics_url, "/metrics")
        assert status == 200
        assert 'reach_agent_requests_total{agent="tel"' in text
        status, health = await http_get(agent.metrics_url, "/healthz")
        assert status == 200
        assert msgspec.json.decode(health)["status"] == "ok"
        status, rtext = await http_get(registry.metrics_url, "/metrics")
        assert status == 200
        assert 'reach_registry_agents{capability="tel.echo",status="UP"} 1.0' in rtext
        assert (await http_get(registry.metrics_url, "/healthz"))[0] == 200
        assert (await http_get(registry.metrics_url, "/nope"))[0] == 404
        # the rest needs promtool: the checks above ran without it
        promtool = need("promtool", "apt-get install prometheus")
        for exposition in (text, rtext, ref_client):
            proc = await asyncio.create_subprocess_exec(
                promtool,
                "check",
                "metrics",
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )
            out, _ = await proc.communicate(exposition.encode())
            assert proc.returncode == 0, out.decode()
            assert out.decode().strip() == "", out.decode()
        url = agent.metrics_url
    with pytest.raises(ConnectionRefusedError):
        await http_get(url, "/metrics")  # closed with the agent


async def test_a_broken_health_check_says_503(settings):
    telemetry = Telemetry()
    telemetry.add_health("always down", lambda: False)
    server = await telemetry.serve()
    try:
        status, body = await http_get(server.url, "/healthz")
        assert status == 503
        assert msgspec.json.decode(body)["checks"] == {"always down": False}
    finally:
        await server.close()


async def test_healthz_answers_even_when_a_check_raises():
    telemetry = Telemetry()

    def boom() -> bool:
        raise RuntimeError("check broke")

    telemetry.add_health("broken", boom)
    server = await telemetry.serve()
    try:
        async with asyncio.timeout(10):
            status, body = await http_get(server.url, "/healthz")
        assert status == 503
        assert msgspec.json.decode(body)["checks"] == {"broken": False}
    finally:
        await server.close()


async def test_two_agents_on_one_telemetry_share_its_metrics_port(settings):
    """Each reads REACH_METRICS_PORT: the second joins the first's server, and a port
    taken by someone else is a ConfigurationError, not a raw OSError."""
    telemetry = Telemetry()
    first = echo_agent(settings, telemetry, "tel-a", metrics_port=0)
    async with first:
        port = int(first.metrics_url.rsplit(":", 1)[1])
        second = echo_agent(settings, telemetry, "tel-b", metrics_port=port)
        async with second:
            assert second.metrics_url == first.metrics_url
            status, text = await http_get(first.metrics_url, "/metrics")
            assert status == 200
            assert 'agent_id="tel-a"' in text
            assert 'agent_id="tel-b"' in text
        assert (await http_get(first.metrics_url, "/metrics"))[0] == 200  # still first's
        other = echo_agent(settings, Telemetry(), "tel-c", metrics_port=port)
        with pytest.raises(reach.ConfigurationError, match=str(port)):
            await other.start()
        assert other.metrics_url is None


async def test_an_application_error_code_is_not_a_metric_label(settings):
    """Codes come from handlers (and could carry ids): the agent counts them as refused."""
    registry = CollectorRegistry()
    telemetry = Telemetry(registry)
    agent = Agent("tel", "tel-codes", settings=settings, telemetry=telemetry)

    @agent.capability("tel.codes")
    async def codes(req: dict) -> dict:
        raise reach.RemoteError("no quota", code=f"quota_{req['tenant']}")

    async with agent, Client(settings=settings, telemetry=telemetry) as client:
        for tenant in ("a", "b", "c"):
            with pytest.raises(reach.HandlerFailed):
                await client.call("tel.codes", {"tenant": tenant}, agent_id="tel-codes")
        text = telemetry.exposition().decode()
        assert "quota_" not in text
        labels = {"agent": "tel", "capability": "tel.codes", "priority": "normal"}
        assert sample(registry, "reach_agent_requests_total", **labels, outcome="refused") == 3
