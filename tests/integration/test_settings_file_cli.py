"""`reach --config FILE` reaches the processes a command starts, not only the command."""

import asyncio
import os
import signal
import sys

from reach import Client, ReachSettings
from reach.testing import unique_prefix
from tests.integration.test_cli import read_line_containing


async def test_the_registry_reach_up_starts_reads_the_same_settings_file(tmp_path):
    prefix = unique_prefix()
    (tmp_path / "reach.toml").write_text(f'subject_prefix = "{prefix}"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("REACH_")}
    up = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "reach.cli",
        "--config",
        "reach.toml",
        "up",
        "--port",
        "-1",
        "--data-dir",
        str(tmp_path / "data"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=tmp_path,
        env=env,
    )
    try:
        url = (await read_line_containing(up.stdout, "nats://")).strip()
        settings = ReachSettings(nats_url=url, subject_prefix=prefix)
        async with Client(settings=settings) as client:
            # answered only by a registry that took the file's prefix (no-responders else)
            reply = await client.nc.request(client.subjects.registry("list"), b"{}", timeout=10)
        assert b"ERROR" not in reply.data
    finally:
        if up.returncode is None:
            up.send_signal(signal.SIGINT)
        async with asyncio.timeout(30):
            await up.wait()
