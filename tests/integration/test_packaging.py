"""What a pip user gets: the wheel holds the demo, the example agents and the nats-server
config, and ``reach demo``, ``reach up`` and ``reach examples`` work from the wheel alone, in
a directory outside the checkout.

The wheel is built from a copy of the sources (the working tree stays clean) and unpacked
into a directory put first on PYTHONPATH, ahead of the editable install; its dependencies
come from the test's environment."""

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
EXAMPLES = sorted(
    p.name
    for p in (ROOT / "reach/examples").iterdir()
    if p.suffix in {".py", ".toml"} and p.name != "__init__.py"
)
DECOY = 'print("DECOY RAN")\nraise SystemExit(3)\n'


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "reach", src / "reach", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert build.returncode == 0, build.stderr
    (built,) = out.glob("agent_reach_nats-*.whl")
    return built


@pytest.fixture(scope="module")
def site(wheel, tmp_path_factory) -> Path:
    """The wheel unpacked, as pip would lay it into site-packages."""
    site = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(wheel) as whl:
        whl.extractall(site)
    return site


@pytest.fixture
def elsewhere(tmp_path) -> Path:
    """A current directory outside the checkout, with decoys of the demo's file names."""
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    for name in ("demo.py", "logistics.py", "intent.py", "aftersales.py"):
        (cwd / name).write_text(DECOY)
    return cwd


def from_wheel(site: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(site), "PYTHONDONTWRITEBYTECODE": "1"}


def test_the_wheel_holds_the_demo_the_examples_and_the_server_config(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"demo.py", "logistics.py", "http_service.py", "wrap.toml"} <= set(EXAMPLES)
    assert {f"reach/examples/{name}" for name in EXAMPLES} <= names
    assert "reach/examples/__init__.py" in names
    assert "reach/nats-server.conf" in names
    shipped = zipfile.ZipFile(wheel).read("reach/nats-server.conf")
    assert shipped == (ROOT / "nats-server.conf").read_bytes()


def test_the_checkouts_nats_server_conf_is_the_shipped_one():
    # One source: the top-level file (what docs, benches and tests name) links to the
    # package's; if it is ever made a copy again, the two must not drift.
    shipped = (ROOT / "reach/nats-server.conf").read_bytes()
    assert (ROOT / "nats-server.conf").read_bytes() == shipped
    assert b"sync_interval: always" in shipped


def test_reach_is_imported_from_the_unpacked_wheel(site, elsewhere):
    probe = subprocess.run(
        [sys.executable, "-c", "import reach.examples; print(reach.examples.__file__)"],
        cwd=elsewhere,
        env=from_wheel(site),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert probe.returncode == 0, probe.stderr
    assert Path(probe.stdout.strip()).is_relative_to(site)


async def test_reach_demo_runs_from_the_wheel_outside_the_checkout(site, elsewhere):
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "reach.cli", "demo"),
        cwd=elsewhere,
        env=from_wheel(site),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(120):
        out, err = await proc.communicate()
    text = out.decode()
    assert proc.returncode == 0, err.decode()
    assert "DECOY RAN" not in text
    for seen in (
        "logistics-1",
        "logistics-2",
        "logistics-3 is killed",
        "12 of 12 succeeded, 0 lost",
        "logistics-2 is drained",
        "fails fast",
        "Demo OK",
    ):
        assert seen in text, seen


async def test_reach_up_elsewhere_runs_the_shipped_config(site, elsewhere, tmp_path):
    # No nats-server.conf in the current directory: the package's is used, so JetStream
    # fsyncs every write and has the config's limits (the server's defaults would not).
    up = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "reach.cli", "up", "--port", "-1", "--monitor-port", "-1"),
        *("--no-registry", "--data-dir", str(tmp_path / "data")),
        cwd=elsewhere,
        env=from_wheel(site),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    assert up.stderr is not None
    try:
        async with asyncio.timeout(30):
            while True:
                line = (await up.stderr.readline()).decode()
                assert line, "reach up ended before it named its config"
                if line.startswith("# config "):
                    break
        config, monitoring = line.removeprefix("# config ").strip().split(", monitoring ")
        assert Path(config) == site / "reach" / "nats-server.conf"
        varz = await asyncio.to_thread(_get_json, f"{monitoring}/varz")
        assert varz["jetstream"]["config"]["sync_always"] is True
        assert varz["jetstream"]["config"]["max_memory"] == 256 * 1024 * 1024
        assert varz["max_payload"] == 1024 * 1024
    finally:
        if up.returncode is None:
            up.send_signal(signal.SIGINT)
        async with asyncio.timeout(30):
            await up.communicate()
    assert up.returncode == 0
    log = (tmp_path / "data" / "nats-server.log").read_text()
    assert "Using configuration file" in log


def test_reach_up_refuses_a_config_that_is_not_there(elsewhere):
    run = subprocess.run(
        [sys.executable, "-m", "reach.cli", "up", "--config", "nope.conf", "--port", "-1"],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 1
    assert run.stderr == (
        "error: bad_request: --config nope.conf: no such file; give the path of a nats-server"
        " config\n"
    )
    assert not (elsewhere / ".reach-data").exists()  # nothing was started


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


def test_reach_examples_lists_and_copies_what_the_wheel_ships(site, elsewhere):
    def reach(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "reach.cli", *args],
            cwd=elsewhere,
            env=from_wheel(site),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    listed = reach("examples")
    assert listed.returncode == 0, listed.stderr
    assert str(site / "reach" / "examples") in listed.stdout
    for name in EXAMPLES:
        assert f"  {name}  " in listed.stdout, name
    assert "reach examples copy DIR" in listed.stdout

    copied = reach("examples", "copy", "mine")
    assert copied.returncode == 0, copied.stderr
    assert sorted(p.name for p in (elsewhere / "mine").iterdir()) == EXAMPLES
    for name in EXAMPLES:
        shipped = (site / "reach" / "examples" / name).read_bytes()
        assert (elsewhere / "mine" / name).read_bytes() == shipped, name

    (elsewhere / "mine" / "logistics.py").write_text("# mine now\n")
    again = reach("examples", "copy", "mine")
    assert again.returncode == 1
    assert again.stderr.count("\n") == 1, again.stderr
    assert "already has aftersales.py" in again.stderr
    assert "nothing was copied" in again.stderr
    assert (elsewhere / "mine" / "logistics.py").read_text() == "# mine now\n"
