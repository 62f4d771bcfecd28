"""``reach run MODULE:ATTR [--reload]``: an agent from an import path in the current
directory, served until a signal; restarted when its file changes; bad paths refused in one
line with exit code 2."""

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from reach import Client, ReachError, ReachSettings
from reach.testing import eventually

AGENT = """
import os

from reach import Agent, ReachSettings

REPLY = {reply!r}


def make() -> Agent:
    agent = Agent("runner", settings=ReachSettings())

    @agent.capability("run.hello")
    async def hello(req: dict) -> dict:
        return {{"reply": REPLY, "pid": os.getpid()}}

    return agent


agent = make()
"""


def write_agent(folder: Path, reply: str) -> None:
    (folder / "hello_agent.py").write_text(AGENT.format(reply=reply))


def env_for(settings: ReachSettings) -> dict[str, str]:
    return {
        **os.environ,
        "REACH_NATS_URL": settings.nats_url,
        "REACH_SUBJECT_PREFIX": settings.subject_prefix,
        "PYTHONDONTWRITEBYTECODE": "1",  # a rewritten file is read again, whatever its mtime
    }


async def reach_run(folder: Path, settings: ReachSettings, *args: str):
    return await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "reach.cli", "run", *args),
        cwd=folder,
        env=env_for(settings),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )


async def answer(client: Client) -> dict | None:
    """The agent's reply, or None while no instance serves (one is restarting)."""
    try:
        return await client.request("run.hello", {}, timeout=2)
    except ReachError:
        return None


async def stop(proc: asyncio.subprocess.Process, sig: signal.Signals = signal.SIGINT) -> bytes:
    if proc.returncode is None:
        proc.send_signal(sig)
    async with asyncio.timeout(60):
        _, err = await proc.communicate()
    return err


@pytest.mark.parametrize(("target", "sig"), [("agent", signal.SIGTERM), ("make", signal.SIGINT)])
async def test_reach_run_serves_an_agent_or_a_factory_until_a_signal(
    tmp_path, reach_settings, target, sig
):
    write_agent(tmp_path, "hello")
    proc = await reach_run(tmp_path, reach_settings, f"hello_agent:{target}")
    try:
        async with Client(settings=reach_settings) as client:
            replies: list[dict] = []

            async def answered() -> bool:
                replies.append(await answer(client) or {})
                return replies[-1].get("reply") == "hello"

            await eventually(answered, timeout=30)
            assert replies[-1]["pid"] == proc.pid  # served by `reach run` itself
    finally:
        err = await stop(proc, sig)
    assert proc.returncode == 0, err.decode()
    assert "serving run.hello" in err.decode()


async def test_reach_run_reload_restarts_the_agent_when_its_file_changes(tmp_path, reach_settings):
    write_agent(tmp_path, "first")
    proc = await reach_run(tmp_path, reach_settings, "hello_agent:make", "--reload")
    assert proc.stderr is not None
    seen: list[dict] = []
    try:
        async with Client(settings=reach_settings) as client:

            async def replied(reply: str) -> bool:
                got = await answer(client)
                if got is not None:
                    seen.append(got)
                return got is not None and got["reply"] == reply

            # The watcher starts as soon as the first child is spawned, long before that
            # child has imported its agent and answers: a change made now is seen.
            await eventually(lambda: replied("first"), timeout=30)
            first_pid = seen[-1]["pid"]
            write_agent(tmp_path, "second, after the reload")
            await eventually(lambda: replied("second, after the reload"), timeout=60)
            second_pid = seen[-1]["pid"]
    finally:
        err = (await stop(proc)).decode()
    assert proc.returncode == 0, err
    assert first_pid != second_pid
    assert proc.pid not in (first_pid, second_pid)  # children of the watching `reach run`
    assert "hello_agent.py changed; restarting" in err
    for pid in (first_pid, second_pid):  # stopped with their parent, none left behind
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


MODULE = """
import reach

agent = reach.Agent("bad-input", settings=reach.ReachSettings(nats_url="nats://127.0.0.1:1"))
NUMBER = 7


def needs_args(settings):
    return agent


def returns_text():
    return "not an agent"


async def async_factory():
    return agent
"""


BAD_PATHS = [
    ("mod_ok", "'mod_ok' is not an import path"),
    ("mod_ok:", "'mod_ok:' is not an import path"),
    ("missing_mod:agent", "no module 'missing_mod' in"),
    ("pkg.missing:agent", "no module 'pkg.missing' in"),
]
BAD_ATTRIBUTES = [
    ("mod_ok:nothing", "module 'mod_ok' has no attribute 'nothing' (its agents: agent)"),
    ("mod_ok:NUMBER", "mod_ok:NUMBER is a int, not a reach.Agent"),
    ("mod_ok:needs_args", "mod_ok:needs_args needs arguments"),
    ("mod_ok:returns_text", "mod_ok:returns_text() returned a str, not a reach.Agent"),
    ("mod_ok:async_factory", "mod_ok:async_factory is async"),
]


def run_refused(folder: Path, *args: str) -> str:
    """``reach run ARGS`` in ``folder``: asserts exit code 2 and one line; that line."""
    (folder / "mod_ok.py").write_text(MODULE)
    (folder / "pkg").mkdir(exist_ok=True)
    (folder / "pkg" / "__init__.py").write_text("")
    run = subprocess.run(
        [sys.executable, "-m", "reach.cli", "run", *args],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 2, run.stderr
    assert run.stderr.startswith("error: bad_request: "), run.stderr
    assert run.stderr.count("\n") == 1, run.stderr
    return run.stderr


@pytest.mark.parametrize(("target", "said"), BAD_PATHS + BAD_ATTRIBUTES)
def test_reach_run_refuses_a_bad_target_in_one_line(tmp_path, target, said):
    assert said in run_refused(tmp_path, target)


@pytest.mark.parametrize(("target", "said"), BAD_PATHS)
def test_reach_run_reload_refuses_a_module_it_cannot_find_before_watching(tmp_path, target, said):
    # What the module holds is judged by the child each time it starts (so that a fix to
    # the file is picked up); a module that is not there at all is refused at once.
    assert said in run_refused(tmp_path, target, "--reload")


def test_a_module_that_fails_to_import_shows_its_own_error(tmp_path):
    # A missing dependency of the user's module is the module's error, not "no module".
    (tmp_path / "needs_dep.py").write_text("import not_installed_dependency\n")
    run = subprocess.run(
        [sys.executable, "-m", "reach.cli", "run", "needs_dep:agent"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode != 0
    assert "No module named 'not_installed_dependency'" in run.stderr
    assert "no module 'needs_dep'" not in run.stderr


def test_reload_without_watchfiles_says_what_to_install(tmp_path):
    (tmp_path / "mod_ok.py").write_text(MODULE)
    blocked = (
        "import sys; sys.modules['watchfiles'] = None\n"  # as if it were not installed
        "from reach.cli import main\n"
        "raise SystemExit(main(['run', 'mod_ok:agent', '--reload']))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", blocked],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 2, run.stderr
    assert run.stderr.count("\n") == 1, run.stderr
    assert "pip install watchfiles" in run.stderr
    assert "agent-reach-nats[edge]" in run.stderr


async def test_reach_config_reaches_the_agent_the_module_builds(reach_settings, tmp_path):
    """`reach --config F run`: the agent's own ReachSettings() reads F (its prefix here)."""
    write_agent(tmp_path, "from the file")
    config = tmp_path / "reach.toml"
    config.write_text(
        f'nats_url = "{reach_settings.nats_url}"\n'
        f'subject_prefix = "{reach_settings.subject_prefix}"\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("REACH_")}
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "reach.cli", "--config", str(config), "run", "hello_agent:agent"),
        cwd=tmp_path,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with Client(settings=reach_settings) as client:
            await eventually(lambda: answer(client), timeout=60)
            assert (await answer(client))["reply"] == "from the file"
    finally:
        await stop(proc, signal.SIGTERM)
