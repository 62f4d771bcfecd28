"""Headers count against max_payload. The client measures them only for payloads within
HEADROOM (4096) of the limit, which holds for its own bounded headers; a traced call also
carries the caller's OpenTelemetry baggage (up to 8 KiB), so it is always measured: before,
a payload just under the headroom went out unmeasured and the server closed the
connection."""

import pytest
from opentelemetry import baggage, context
from opentelemetry.sdk.trace import TracerProvider

import reach
from reach import Client, Telemetry


async def test_a_traced_call_with_large_baggage_is_measured_with_its_headers(reach_settings):
    telemetry = Telemetry(tracer_provider=TracerProvider())
    async with Client(settings=reach_settings, telemetry=telemetry) as client:
        near = b"x" * (client.nc.max_payload - 5000)
        ctx = baggage.set_baggage("a", "v" * 3000)
        ctx = baggage.set_baggage("b", "w" * 3000, context=ctx)
        token = context.attach(ctx)
        try:
            with pytest.raises(reach.ConfigurationError, match="max_payload"):
                await client.call("big.op", near, timeout=2)
        finally:
            context.detach(token)
        assert client.connected
        assert client.nc.stats["reconnects"] == 0


def test_a_client_name_is_bounded(reach_settings):
    """It goes in every request's headers, which the size check counts on being small."""
    with pytest.raises(reach.ConfigurationError, match="client name"):
        Client(settings=reach_settings, name="n" * 200)
