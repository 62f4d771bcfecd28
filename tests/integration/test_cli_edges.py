"""The command line's edges, through real processes: payloads from stdin or a file, JSON
output that is JSON alone, a second Ctrl-C while a drain is under way, and a second
`reach up` on a data dir or port that one already uses."""

import asyncio
import contextlib
import json
import os
import signal
import sys
import textwrap

from reach import Agent, Client, Registry
from reach.testing import eventually

BIG = 900_000  # characters: past what one command-line argument may hold on Linux


def cli_env(settings=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("REACH_")}
    if settings is not None:
        env |= {
            "REACH_NATS_URL": settings.nats_url,
            "REACH_SUBJECT_PREFIX": settings.subject_prefix,
        }
    return env


async def reach(settings, *args, stdin=None, cwd=None, timeout=120):
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "reach.cli",
        *args,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=cwd,
        env=cli_env(settings),
    )
    async with asyncio.timeout(timeout):
        out, err = await proc.communicate(stdin)
    return proc.returncode, out.decode(), err.decode()


def strict_json(text):
    """``json.loads`` that refuses NaN and Infinity too (Python's own writes them)."""

    def constant(name):
        raise AssertionError(f"{name} is not JSON")

    return json.loads(text, parse_constant=constant)


async def line_with(stream, text, timeout=60):
    async with asyncio.timeout(timeout):
        while True:
            line = (await stream.readline()).decode()
            if not line:
                raise AssertionError(f"the stream ended before {text!r}")
            if text in line:
                return line.rstrip("\n")


def gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# -- payloads ----------------------------------------------------------------------------


async def test_a_payload_comes_from_stdin_or_a_file(reach_settings, tmp_path):
    agent = Agent("sizer", settings=reach_settings)

    @agent.capability("edge.size")
    async def size(p: dict) -> dict:
        return {"chars": len(p["text"])}

    @agent.task("edge.size.task")
    async def size_task(p: dict) -> dict:
        return {"chars": len(p["text"])}

    big = json.dumps({"text": "x" * BIG}).encode()
    (tmp_path / "big.json").write_bytes(big)
    async with agent, Client(settings=reach_settings) as client:
        code, out, err = await reach(reach_settings, "call", "edge.size", "-", stdin=big)
        assert (code, strict_json(out)) == (0, {"chars": BIG}), err
        code, out, err = await reach(reach_settings, "call", "edge.size", "@big.json", cwd=tmp_path)
        assert (code, strict_json(out)) == (0, {"chars": BIG}), err

        code, out, err = await reach(
            reach_settings, "submit", "edge.size.task", "-", "--wait", stdin=b'{"text": "abc"}'
        )
        assert (code, strict_json(out)) == (0, {"chars": 3}), err

        sub = await client.subscribe("edge.sizes")
        async with sub:
            code, _, err = await reach(
                reach_settings, "publish", "edge.sizes", "@big.json", cwd=tmp_path
            )
            assert code == 0, err
            async with asyncio.timeout(60):
                msg = await anext(aiter(sub))
        assert json.loads(msg.data) == {"text": "x" * BIG}

        # a file that is not there, or not JSON: one line, nothing sent
        code, out, err = await reach(
            reach_settings, "call", "edge.size", "@missing.json", cwd=tmp_path
        )
        assert (code, out) == (1, "")
        assert err.splitlines() == [
            "error: bad_request: payload file 'missing.json' not found: give an existing"
            " file after @"
        ]
        (tmp_path / "bad.json").write_text("{nope")
        code, out, err = await reach(
            reach_settings, "publish", "edge.sizes", "@bad.json", cwd=tmp_path
        )
        assert (code, out) == (1, "")
        [line] = err.splitlines()
        assert line.startswith("error: bad_request: payload file 'bad.json' is not valid JSON")


# -- JSON output --------------------------------------------------------------------------


async def test_every_documented_json_output_is_json_and_nothing_else(reach_settings):
    settings = reach_settings.model_copy(update={"task_ack_wait": 2.0})
    agent = Agent("jsonner", settings=settings)

    @agent.capability("edge.echo")
    async def echo(p: dict) -> dict:
        return p

    @agent.task("edge.done")
    async def done(p: dict) -> dict:
        return {"ok": True}

    @agent.task("edge.broken", max_attempts=1)
    async def broken(p: dict) -> dict:
        raise ValueError("broken on purpose")

    async with Registry(settings=settings), agent, Client(settings=settings) as client:

        async def listed():
            return [r.info.agent_id for r in await client.agents()] == [agent.agent_id]

        await eventually(listed, timeout=30)
        ok = await client.submit("edge.done", {})
        assert await ok.result(timeout=30) == {"ok": True}
        failed = await client.submit("edge.broken", {})
        await failed.wait(timeout=30)

        async def dead_lettered():
            return len(await client.dead_letters("edge.broken")) == 1

        await eventually(dead_lettered, timeout=30)
        [dead] = await client.dead_letters("edge.broken")

        commands = [
            ["agents", "--json"],
            ["tasks", "--json"],
            ["tasks", "--state", "SUCCEEDED", "--json"],  # any case
            ["tasks", "--state", "succeeded", "--json"],
            ["tasks", ok.task_id, "--json"],
            ["tasks", "cancel", ok.task_id, "--json"],
            ["tasks", "init", "--json"],
            ["dlq", "list", "--json"],
            ["dlq", "show", str(dead.seq), "--json"],
            ["status", "--interval", "0", "--json"],
        ]
        results = await asyncio.gather(*(reach(settings, *c) for c in commands))
        got = {}
        for command, (code, out, err) in zip(commands, results, strict=True):
            assert code == 0, (command, err)
            got[" ".join(command[:3])] = strict_json(out)  # the whole of stdout

        assert [a["info"]["agent_id"] for a in got["agents --json"]] == [agent.agent_id]
        assert {t["task_id"] for t in got["tasks --json"]} == {ok.task_id, failed.task_id}
        assert [t["task_id"] for t in got["tasks --state SUCCEEDED"]] == [ok.task_id]
        assert got["tasks --state succeeded"] == got["tasks --state SUCCEEDED"]
        assert got[f"tasks {ok.task_id} --json"]["result"] == {"ok": True}
        assert got[f"tasks cancel {ok.task_id}"]["state"] == "SUCCEEDED"
        assert set(got["tasks init --json"]) == {"streams", "buckets", "replicas"}
        assert [d["seq"] for d in got["dlq list --json"]] == [dead.seq]
        assert got[f"dlq show {dead.seq}"]["task_id"] == failed.task_id
        assert "capabilities" in got["status --interval 0"]

        # status events and the control commands: JSON lines, JSON objects
        watch = await asyncio.create_subprocess_exec(
            sys.executable,
            *("-m", "reach.cli", "watch", "--json", "--count", "1"),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=cli_env(settings),
        )
        try:
            await line_with(watch.stderr, "watching")
            code, out, err = await reach(settings, "pause", agent.agent_id)
            assert (code, strict_json(out)["status"]) == (0, "PAUSED"), err
            async with asyncio.timeout(60):
                out, _ = await watch.communicate()
            [event] = [strict_json(line) for line in out.decode().splitlines()]
            assert (event["agent_id"], event["new"]) == (agent.agent_id, "PAUSED")
        finally:
            if watch.returncode is None:
                watch.kill()
                await watch.wait()


# -- a second Ctrl-C ----------------------------------------------------------------------

HOLDING_AGENT = """
import asyncio, sys
from reach import Agent

agent = Agent("holder", "holder-1")

@agent.capability("edge.hold")
async def hold(p: dict) -> dict:
    print("holding", file=sys.stderr, flush=True)
    await asyncio.Event().wait()  # in flight until the process ends
    return {}

agent.run()
"""


async def test_a_second_ctrl_c_stops_an_agent_that_drains_at_once(reach_settings, tmp_path):
    script = tmp_path / "holder.py"
    script.write_text(textwrap.dedent(HOLDING_AGENT))
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(script),
        stderr=asyncio.subprocess.PIPE,
        env=cli_env(reach_settings) | {"REACH_DRAIN_TIMEOUT": "600"},
    )
    try:
        await line_with(proc.stderr, "serving edge.hold")
        async with Client(settings=reach_settings) as client:
            call = asyncio.create_task(client.request("edge.hold", {}, timeout=600))
            try:
                await line_with(proc.stderr, "holding")
                proc.send_signal(signal.SIGINT)
                first = await line_with(proc.stderr, "stopping:")
                assert first == (
                    "stopping: draining in-flight work for up to 600s;"
                    " press Ctrl-C again to stop now"
                )
                proc.send_signal(signal.SIGINT)  # the drain would wait 600 s
                async with asyncio.timeout(60):
                    rest = (await proc.stderr.read()).decode()
                    assert await proc.wait() == 130
            finally:
                call.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await call
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert [line for line in rest.splitlines() if "stopping" in line] == [
        "stopping now: in-flight work is abandoned"
    ]
    assert "Traceback" not in rest
    assert "KeyboardInterrupt" not in rest


async def reach_up(*args, cwd):
    return await asyncio.create_subprocess_exec(
        sys.executable,
        *("-m", "reach.cli", "up", "--monitor-port", "-1", *args),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=cwd,
        env=cli_env(),
    )


async def stop_up(up):
    if up.returncode is None:
        up.send_signal(signal.SIGINT)
        async with asyncio.timeout(60):
            await up.communicate()


async def test_a_second_ctrl_c_stops_reach_up_and_what_it_started_at_once(tmp_path):
    up = await reach_up("--port", "-1", "--data-dir", str(tmp_path / "data"), cwd=tmp_path)
    try:
        server = int((await line_with(up.stderr, "nats-server pid")).split()[3].rstrip(","))
        registry = int((await line_with(up.stderr, "registry pid")).split()[3])
        # A registry that does not stop (stopped itself): the drain would wait for it.
        os.kill(registry, signal.SIGSTOP)
        up.send_signal(signal.SIGINT)
        assert (await line_with(up.stderr, "stopping:")).endswith(
            "; press Ctrl-C again to stop now"
        )
        up.send_signal(signal.SIGINT)
        async with asyncio.timeout(60):
            rest = (await up.stderr.read()).decode()
            assert await up.wait() == 130
    finally:
        await stop_up(up)
    assert "stopping now: in-flight work is abandoned" in rest
    assert "Traceback" not in rest
    # nothing it started outlives it (reaped by init soon after)
    await eventually(lambda: gone(server) and gone(registry), timeout=30)


# -- a second `reach up` ------------------------------------------------------------------


async def test_a_second_reach_up_is_refused_before_it_touches_the_first_ones_store(tmp_path):
    data = tmp_path / "data"
    first = await reach_up("--port", "-1", "--no-registry", "--data-dir", str(data), cwd=tmp_path)
    try:
        url = (await line_with(first.stdout, "nats://")).strip()
        port = url.rsplit(":", 1)[1]
        pid_line = await line_with(first.stderr, "nats-server pid")
        server = int(pid_line.split()[3].rstrip(","))
        log = data / "nats-server.log"

        # the same data dir (any port): its lock file says who has it
        again = await reach_up("--port", "-1", "--data-dir", str(data), cwd=tmp_path)
        async with asyncio.timeout(60):
            out, err = await again.communicate()
        assert (again.returncode, out) == (1, b"")
        assert err.decode().splitlines() == [
            f"error: bad_request: {data} is in use by another 'reach up' (pid {first.pid}):"
            " stop it, or give this one a --data-dir of its own"
        ]

        # the same port (another data dir): refused before a nats-server starts
        other = tmp_path / "other"
        again = await reach_up("--port", port, "--data-dir", str(other), cwd=tmp_path)
        async with asyncio.timeout(60):
            out, err = await again.communicate()
        assert (again.returncode, out) == (1, b"")
        assert err.decode().splitlines() == [
            f"error: bad_request: port {port} on 127.0.0.1 is taken (another nats-server or"
            " 'reach up' runs?): stop it, or pass --port N (--port -1 picks a free port)"
        ]
        assert not (other / "nats-server.log").exists()

        # no other nats-server ran on the first one's store: its log ("[pid] ...") is its own
        writers = {line[1 : line.index("]")] for line in log.read_text().splitlines()}
        assert writers == {str(server)}
        assert first.returncode is None
    finally:
        await stop_up(first)
    assert first.returncode == 0
