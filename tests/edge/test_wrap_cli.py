"""`reach wrap` from the command line and from a TOML file: parsing, refusals, the shipped
example, and the command as a process that serves until SIGTERM."""

import asyncio
import os
import runpy
import signal
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

import reach
from reach._agent import State
from reach._cli_wrap import spec_data
from reach._wrap import HttpWrapper, build_spec, load_config
from reach.cli import build_parser, main
from reach.testing import eventually

from .wrap_upstream import serve_app, serve_upstream

ROOT = Path(__file__).parents[2]
EXAMPLE = ROOT / "reach/examples/wrap.toml"


def test_the_issue_command_line_parses_into_a_spec():
    args = build_parser().parse_args(
        [
            "wrap",
            "--capability",
            "support.ask",
            "--url",
            "http://127.0.0.1:9000/ask",
            "--method",
            "put",
            "--timeout",
            "2.5",
            "--max-concurrency",
            "16",
            "--tags",
            "eu,gpu",
            "--tags",
            "wrapped",
            "--health-url",
            "http://127.0.0.1:9000/healthz",
            "--pause-after",
            "5",
        ]
    )
    spec = build_spec(spec_data(args))
    (ep,) = spec.endpoints
    assert (ep.capability, ep.url, ep.method, ep.timeout) == (
        "support.ask",
        "http://127.0.0.1:9000/ask",
        "PUT",
        2.5,
    )
    assert spec.max_concurrency == 16
    assert spec.tags == ["eu", "gpu", "wrapped"]
    assert spec.agent_name == "wrap-support-ask"
    assert spec.health is not None
    assert (spec.health.url, spec.health.interval, spec.health.pause_after) == (
        "http://127.0.0.1:9000/healthz",
        5.0,
        5,
    )
    # --url is the HTTP endpoint here; the NATS server comes from --nats-url or REACH_*.
    assert not hasattr(args, "url")


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["wrap", "--capability", "a.b"], "needs --capability and --url, or --config"),
        (["wrap", "--config", str(EXAMPLE), "--capability", "a.b"], "drop --capability"),
        (["wrap", "--capability", "a.b", "--url", "ftp://x/"], "is not an http(s) URL"),
        (["wrap", "--capability", "a.b", "--url", "http://x/", "--method", "TRACE"], "method"),
        (["wrap", "--capability", "a.b", "--url", "http://x/", "--pause-after", "1"], "need"),
        (["wrap", "--config", "/nonexistent/wrap.toml"], "/nonexistent/wrap.toml"),
    ],
)
def test_bad_invocations_say_what_is_wrong(capsys, argv, said):
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: bad_request: ")
    assert said in err


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("endpoints = [", "not valid TOML"),
        ("name = 'x'", "endpoints"),
        ("endpoints = []", "declare at least one endpoint"),
        (
            "[[endpoints]]\ncapability = 'a.b'\nurl = 'http://x/'\nmethd = 'GET'",
            "unknown field `methd` - at `$.endpoints[0]`",
        ),
        (
            "[[endpoints]]\ncapability = 'a.b'\nurl = 'http://x/'\n"
            "[[endpoints]]\ncapability = 'a.b'\nurl = 'http://y/'",
            "each capability may be wrapped once",
        ),
        (
            "[health]\nurl = 'http://x/h'\ninterval = 0\n"
            "[[endpoints]]\ncapability = 'a.b'\nurl = 'http://x/'",
            "interval and timeout must be > 0",
        ),
    ],
)
def test_config_errors_name_the_file_and_the_place(tmp_path, text, said):
    path = tmp_path / "wrap.toml"
    path.write_text(text)
    with pytest.raises(reach.ConfigurationError) as info:
        load_config(path)
    assert str(path) in info.value.message
    assert said in info.value.message


async def test_the_example_config_wraps_the_example_service(reach_settings, reach_client):
    app = runpy.run_path(str(ROOT / "reach/examples/http_service.py"))["app"]
    spec = load_config(EXAMPLE)
    assert [e.capability for e in spec.endpoints] == ["helpdesk.ask", "helpdesk.search"]
    async with serve_app(app) as port:
        here = f"http://127.0.0.1:{port}/"

        def moved(url: str) -> str:
            return url.replace("http://127.0.0.1:9000/", here)

        assert spec.health is not None
        spec = msgspec.structs.replace(
            spec,
            endpoints=[msgspec.structs.replace(e, url=moved(e.url)) for e in spec.endpoints],
            health=msgspec.structs.replace(spec.health, url=moved(spec.health.url)),
        )
        async with HttpWrapper(spec, settings=reach_settings) as w:
            answer = await reach_client.request(
                "helpdesk.ask", {"text": "Opening hours?"}, request_id="r-1", timeout=10
            )
            assert answer == {
                "answer": "We answer every day from 8:00 to 20:00.",
                "request_id": "r-1",
            }
            hits = await reach_client.request("helpdesk.search", {"q": "RET"}, timeout=10)
            assert hits == {"hits": ["returns"]}
            with pytest.raises(reach.BadRequest, match="upstream HTTP 422"):
                await reach_client.request("helpdesk.ask", {"txt": "?"}, timeout=10)
            assert w.health is not None
            await eventually(lambda: w.health.probes >= 1)
            assert w.health.failures == 0
            assert w.agent.state is State.UP
            info = w.agent.info()
            assert (info.name, info.tags, info.max_concurrency) == (
                "helpdesk",
                ["wrapped", "eu"],
                8,
            )
            assert info.capabilities[0].description == "Answer a customer's question"


async def test_reach_wrap_serves_until_sigterm_then_drains(
    nats_server, reach_settings, upstream, tmp_path
):
    config = tmp_path / "wrap.toml"
    config.write_text(
        'agent_id = "cli-wrap-1"\n'
        f'[[endpoints]]\ncapability = "cli.echo"\nurl = "{upstream.url("/echo")}"\n'
        f'[[endpoints]]\ncapability = "cli.hold"\nurl = "{upstream.url("/hold")}"\n'
        "timeout = 30\n"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "reach.cli",
        "wrap",
        "--config",
        str(config),
        "--nats-url",
        nats_server.url,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "REACH_SUBJECT_PREFIX": reach_settings.subject_prefix},
    )
    try:
        assert proc.stderr is not None
        async with asyncio.timeout(30):
            line = (await proc.stderr.readline()).decode()
        assert line.startswith("# wrapping as agent cli-wrap-1: cli.echo -> POST http://")
        async with reach.Client(settings=reach_settings) as client:
            await eventually(lambda: served(client), timeout=30)
            reply = await client.call("cli.echo", {"x": 1}, timeout=10)
            assert reply.value == {"got": {"x": 1}}
            assert reply.agent_id == "cli-wrap-1"
            in_flight = asyncio.create_task(client.request("cli.hold", {}, timeout=30))
            await eventually(lambda: upstream.held == 1)
            proc.send_signal(signal.SIGTERM)
            await eventually(lambda: draining(client, "cli-wrap-1"))
            assert proc.returncode is None  # it waits for the request in flight
            upstream.release.set()
            assert await in_flight == {"held": True}
        async with asyncio.timeout(30):
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def draining(client: reach.Client, agent_id: str) -> bool:
    """Its heartbeat says PAUSED: a draining agent advertises that."""
    msg = await client.nc.request(client.subjects.ping(agent_id), b"", timeout=5)
    return msgspec.json.decode(msg.data)["status"] == "PAUSED"


async def served(client: reach.Client) -> bool:
    try:
        await client.request("cli.echo", {}, timeout=5, max_attempts=1)
    except reach.CapabilityNotFound:
        return False
    return True


@pytest.fixture
async def upstream():
    async with serve_upstream() as up:
        yield up


def test_reach_and_its_cli_load_no_http_library():
    code = "import sys, reach, reach.cli; print(sorted({'httpx', 'uvicorn'} & set(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]"


def test_the_wrapper_is_public_as_reach_wrap_and_only_loads_httpx_there():
    code = (
        "import sys, reach; assert 'httpx' not in sys.modules;"
        " from reach.wrap import HttpWrapper, load_config; import reach._wrap as w;"
        " assert HttpWrapper is w.HttpWrapper and load_config is w.load_config;"
        " print('httpx' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "True"
