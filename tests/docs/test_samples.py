"""Every code sample in README.md and docs/ runs as shown.

A Python block runs as a script in its own process, against a real nats-server (the
``nats_server`` fixture of ``reach.testing``) with a registry running, as after ``reach up``.
The script gets ``REACH_NATS_URL`` and a ``REACH_SUBJECT_PREFIX`` of its page, so it runs
unchanged; its working directory is empty. The blocks of one page run in order, and share
what the page started. An HTML comment on the line before a block says how to run it:

    (none)                                  run it; it must exit 0 (a shell block: see below)
    <!-- run: background ready=text.shout --> start it and keep it running until the page
                                            ends (an agent); wait until an UP instance of
                                            text.shout is in the routing table, or, with
                                            ready=http://..., until that URL answers 2xx.
                                            At the end it gets SIGTERM and must exit 0.
    <!-- run: gateway -->                   run it with `reach gateway` running (started
                                            once per page)
    <!-- run: gateway token=NAME -->        the page's gateway takes one admin token
                                            (REACH_GATEWAY_TOKENS), which every block of the
                                            page finds in $NAME
    <!-- run: pytest -->                    save it as a test file and run pytest on it
    <!-- norun: reason -->                  only compile it (the reason says why)

A loopback address with a port (``127.0.0.1:8080``, ``localhost:8080``) names a free port of
the page: the same port everywhere on the page (also where a block gives it to a server as
``port=8080``), so a sample's gateway or HTTP service is where its client looks.
``127.0.0.1:4222`` stays (it is the default NATS URL).

A shell block (bash, sh, shell) runs only when marked ``<!-- run -->`` or
``<!-- run: gateway -->``: its lines as a bash script in the page's environment and
directory, in its turn among the page's blocks, after ``set -euo pipefail`` and with
``curl`` given ``--fail-with-body``, so an HTTP error fails it (the sample itself says
``curl -s``, as a user types it). It must exit 0 within 60 s; whatever it leaves running is
killed. Without bash or curl the page is skipped, naming how to install them (failed where
``REACH_REQUIRE_TOOLS=1``, as in CI). A block with a curl command must run or say why not
(``<!-- norun: reason -->``), so no HTTP sample goes stale unseen. A console block shows
output: it is never run.

Every shell block (bash, console), run or not, is checked: every ``reach ...`` line, and
every ``reach ...`` after a pipe or ``&&``, must parse with the ``reach`` command's own
parser (usage lines with ``[...]`` or ``|`` only name an existing command), and every
``python -m MODULE`` names a module that exists.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import re
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path

import httpx
import pytest
import yaml

from reach import Client, ReachSettings, Registry
from reach.cli import build_parser
from reach.testing import NatsServer, unique_prefix

from ..tools import need

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*)$")
MARKER = re.compile(r"^\s*<!--\s*(?P<kind>run|norun)\s*(?::\s*(?P<args>.*?))?\s*-->\s*$")
PORT = re.compile(r"\b(127\.0\.0\.1|localhost):(\d{2,5})\b")
PYTHON = {"python", "py"}
SHELL = {"bash", "sh", "shell", "console"}
SHELL_RUN = {"bash", "sh", "shell"}  # a console block shows output too: not a script
RUN_OPTIONS = {"background", "gateway", "pytest"}

#: a shell block runs as a bash script: it stops at the first failing command, and curl
#: fails on an HTTP error (showing the body) as a user would see from the sample's output;
#: ``--fail-with-body`` needs curl 7.76, the samples' ``--json`` 7.82
SHELL_PREAMBLE = """set -euo pipefail
curl() { command curl --fail-with-body --show-error "$@"; }
"""

RUN_TIMEOUT = 60.0  # seconds one foreground block may take
READY_TIMEOUT = 20.0


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    kind: str  # run | norun | check (a shell block without a marker: parsed, not run)
    options: set[str] = field(default_factory=set)
    ready: str = ""
    token: str = ""  # token=NAME: the page's gateway takes a token, given to blocks as $NAME
    reason: str = ""

    @property
    def where(self) -> str:
        page = self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page
        return f"{page}:{self.line}"


def read_blocks(page: Path) -> list[Block]:
    """The fenced blocks of a page, each with the marker on the line before it."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = len(m["indent"]), m["fence"]
        lang = (m["info"].split() or [""])[0].lower()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        i += 1
        kind = "run" if lang in PYTHON else "check"
        block = Block(page, start + 1, lang, "\n".join(body) + "\n", kind)
        before = start - 1
        while before >= 0 and not lines[before].strip():
            before -= 1
        marker = MARKER.match(lines[before]) if before >= 0 else None
        if marker:
            parse_marker(block, marker["kind"], marker["args"] or "")
        blocks.append(block)
    return blocks


def parse_marker(block: Block, kind: str, args: str) -> None:
    block.kind = kind
    if kind == "norun":
        assert args, f"{block.where}: say why a block is not run (<!-- norun: reason -->)"
        block.reason = args
        return
    for word in args.split():
        name, _, value = word.partition("=")
        if name == "ready":
            block.ready = value
        elif name == "token" and value.isidentifier():
            block.token = value
        elif name in RUN_OPTIONS:
            block.options.add(name)
        else:
            raise AssertionError(f"{block.where}: unknown run option {word!r}")
    if block.token and "gateway" not in block.options:
        raise AssertionError(f"{block.where}: token= is the gateway's: say run: gateway")
    if block.lang in SHELL and block.lang not in SHELL_RUN:
        raise AssertionError(f"{block.where}: a {block.lang} block shows output: make it bash")
    if block.lang in SHELL_RUN and block.options - {"gateway"}:
        raise AssertionError(f"{block.where}: a shell block runs in the foreground, or norun")


def runnable(block: Block) -> bool:
    return block.kind == "run" and block.lang in PYTHON | SHELL_RUN


def run_pages() -> list[Path]:
    """Pages with a Python block, or a shell block marked to run."""
    return [p for p in PAGES if any(b.lang in PYTHON or runnable(b) for b in read_blocks(p))]


def shell_pages() -> list[Path]:
    return [p for p in PAGES if any(b.lang in SHELL for b in read_blocks(p))]


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


# -- shell samples ---------------------------------------------------------------------------


#: ``... | reach ...`` or ``... && reach ...``: a command fed by a pipe, or chained after
#: another (the part before it holds no quote or comment that could hide the operator)
CHAINED = re.compile(r"""^[^'"#]*?(?:\||&&|;)\s*(reach .*)$""")


def reach_lines(code: str) -> list[str]:
    """The ``reach ...`` commands of a shell block (prompts, ``&`` and comments removed),
    also those after a pipe or ``&&`` (``cat big.json | reach submit report.build -``)."""
    out = []
    for raw in code.splitlines():
        line = raw.strip().removeprefix("$ ")
        if line.startswith("reach "):
            out.append(line)
        elif chained := CHAINED.match(line):
            out.append(chained[1])
    return out


def module_lines(code: str) -> list[str]:
    return re.findall(r"python3? -m ([A-Za-z_][\w.]*)", code)


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def check_reach_line(line: str) -> str | None:
    """None when ``line`` is a valid ``reach`` command, else what is wrong."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError as exc:
        return f"cannot split: {exc}"
    words = [w for w in words if w != "&"]
    args = words[1:]
    usage = any(c in line.split("#")[0] for c in "[|") or "..." in line.split("#")[0]
    commands = subcommands(build_parser())
    if not args or args[0] not in commands:
        return f"no command {args[:1]} (commands: {', '.join(sorted(commands))})"
    if usage:
        return None  # a usage line: the command exists; its options are in brackets
    try:
        with contextlib.redirect_stderr(io.StringIO()) as err:
            build_parser().parse_args(args)
    except SystemExit as exc:
        return f"the parser refuses it (exit {exc.code}): {err.getvalue().strip()}"
    return None


@pytest.mark.parametrize("page", shell_pages(), ids=page_id)
def test_shell_samples_name_real_commands(page: Path) -> None:
    problems = []
    for block in read_blocks(page):
        if block.lang not in SHELL:
            continue
        for line in reach_lines(block.code):
            problem = check_reach_line(line)
            if problem:
                problems.append(f"{block.where}: {line!r}: {problem}")
        for module in module_lines(block.code):
            if find_spec(module) is None:
                problems.append(f"{block.where}: python -m {module}: no such module")
    assert not problems, "\n".join(problems)


#: a line that runs curl: at the start (after a ``$`` prompt), or after a pipe, ``&&`` or ``;``
CURL = re.compile(r"^\s*(?:\$\s+)?curl\s|(?:\||&&|;)\s*curl\s", re.MULTILINE)


def test_every_curl_sample_runs_or_says_why_not() -> None:
    """A curl sample goes stale without a word unless it runs: each is run or says why not."""
    problems = [
        f"{block.where}: a curl sample neither runs (<!-- run: ... --> on a bash block) nor "
        "says why not (<!-- norun: reason -->)"
        for page in PAGES
        for block in read_blocks(page)
        if CURL.search(block.code)
        and block.kind != "norun"
        and not (block.kind == "run" and block.lang in SHELL_RUN)
    ]
    assert not problems, "\n".join(problems)


def test_every_python_sample_compiles() -> None:
    problems = []
    for page in PAGES:
        for block in read_blocks(page):
            if block.lang in PYTHON:
                try:
                    compile(block.code, block.where, "exec")
                except SyntaxError as exc:
                    problems.append(f"{block.where}: {exc}")
    assert not problems, "\n".join(problems)


def test_python_samples_are_formatted_and_lint_clean(tmp_path: Path) -> None:
    """ruff, as on our own code: samples are read and copied, so they are held to it too."""
    for page in PAGES:
        for block in read_blocks(page):
            if block.lang in PYTHON:
                name = re.sub(r"\W", "_", block.where)
                (tmp_path / f"{name}.py").write_text(block.code, encoding="utf-8")
    ruff = [sys.executable, "-m", "ruff"]
    common = ["--isolated", "--line-length", "100", str(tmp_path)]
    lint = subprocess.run(
        [*ruff, "check", "--select", "E,F,W,I,B,UP", *common], capture_output=True, text=True
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr
    fmt = subprocess.run([*ruff, "format", "--diff", *common], capture_output=True, text=True)
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


# -- python samples --------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Page:
    """One page's run: its prefix, its ports, and what its blocks left running."""

    def __init__(self, page: Path, settings: ReachSettings, workdir: Path) -> None:
        self.page = page
        self.settings = settings
        self.workdir = workdir
        self.ports: dict[str, int] = {}
        blocks = read_blocks(page)
        for block in blocks:  # every port the page names, before any block runs
            for _, port in PORT.findall(block.code + block.ready):
                if port != "4222" and port not in self.ports:
                    self.ports[port] = free_port()
        #: the page's gateway token, if a block asks for one (token=NAME: in $NAME)
        self.token = {b.token: secrets.token_hex(24) for b in blocks if b.token}
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("REACH_")}
        self.env |= {
            "REACH_NATS_URL": settings.nats_url,
            "REACH_SUBJECT_PREFIX": settings.subject_prefix,
            "PYTHONUNBUFFERED": "1",
        }
        self.env |= self.token
        self.running: list[tuple[str, asyncio.subprocess.Process, Path]] = []
        self.gateway = False

    def localise(self, code: str) -> str:
        def swap(m: re.Match[str]) -> str:
            port = m[2]
            if port == "4222":
                return m[0]
            if port not in self.ports:
                self.ports[port] = free_port()
            return f"{m[1]}:{self.ports[port]}"

        code = PORT.sub(swap, code)
        # the same port given to a server as a number (port=9000, --port 9000)
        return re.sub(
            r"\b(port\s*=\s*|--port\s+)(\d{2,5})\b",
            lambda m: m[1] + str(self.ports.get(m[2], m[2])),
            code,
        )

    async def spawn(
        self, name: str, argv: list[str], env: dict[str, str] | None = None, group: bool = False
    ) -> tuple[asyncio.subprocess.Process, Path]:
        """Start ``argv``; ``group``: in a process group of its own, so that a shell block's
        commands (its curl) are killed with it."""
        log = self.workdir / f"{name}.log"
        with log.open("wb") as out:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                cwd=self.workdir,
                env=env or self.env,
                stdout=out,
                stderr=out,
                start_new_session=group,
            )
        return proc, log

    async def run_block(self, block: Block, client: Client) -> None:
        if "gateway" in block.options:
            await self.start_gateway()
        code = self.localise(block.code)
        name = f"block-{block.line}"
        if block.lang in SHELL_RUN:
            path = self.workdir / f"{name}.sh"
            path.write_text(SHELL_PREAMBLE + code, encoding="utf-8")
        else:
            path = self.workdir / (
                f"test_{name.replace('-', '_')}.py" if "pytest" in block.options else f"{name}.py"
            )
            path.write_text(code, encoding="utf-8")
        if block.lang in SHELL_RUN:
            argv = ["bash", str(path)]
        elif "pytest" in block.options:
            argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
            argv += ["-o", "asyncio_mode=auto", "-o", "asyncio_default_fixture_loop_scope=function"]
            argv.append(str(path))
        else:
            argv = [sys.executable, str(path)]
        if "background" in block.options:
            before = await live(client, block.ready)
            proc, log = await self.spawn(name, argv)
            self.running.append((block.where, proc, log))
            await self.wait_ready(
                block.where, self.localise(block.ready), proc, log, client, before
            )
            return
        group = block.lang in SHELL_RUN
        proc, log = await self.spawn(name, argv, group=group)
        try:
            code_ = await asyncio.wait_for(proc.wait(), RUN_TIMEOUT)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            pytest.fail(f"{block.where} ran over {RUN_TIMEOUT}s:\n{tail(log)}")
        finally:
            if group:  # what the shell block started and left (a curl still reading)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        if code_ != 0:
            pytest.fail(f"{block.where} exited {code_}:\n{tail(log)}\n{self.background_logs()}")

    async def wait_ready(
        self,
        where: str,
        ready: str,
        proc: asyncio.subprocess.Process,
        log: Path,
        client: Client | None,
        before: int,
    ) -> None:
        """Wait until ``ready`` (a capability with a new UP instance, or a URL answering
        2xx) while the process runs."""
        if not ready:
            return
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            if proc.returncode is not None:
                pytest.fail(f"{where} exited {proc.returncode} at start:\n{tail(log)}")
            if ready.startswith("http"):
                with contextlib.suppress(httpx.HTTPError):
                    async with httpx.AsyncClient() as http:
                        if (await http.get(ready, timeout=1)).is_success:
                            return
            elif client is not None and await live(client, ready) > before:
                return
            await asyncio.sleep(0.05)
        pytest.fail(f"{where}: not ready ({ready}) in {READY_TIMEOUT}s:\n{tail(log)}")

    async def start_gateway(self) -> None:
        if self.gateway:
            return
        self.gateway = True
        port = self.localise("127.0.0.1:8080").rpartition(":")[2]
        argv = [sys.executable, "-m", "reach.cli", "gateway", "--port", port]
        env = self.env
        if self.token:  # one admin token, as docker-compose.yml's GATEWAY_TOKEN
            env = env | {
                "REACH_GATEWAY_TOKENS": json.dumps({t: ["admin"] for t in self.token.values()})
            }
        proc, log = await self.spawn("gateway", argv, env)
        self.running.append(("reach gateway", proc, log))
        await self.wait_ready(
            "reach gateway", f"http://127.0.0.1:{port}/healthz", proc, log, None, 0
        )

    def background_logs(self) -> str:
        return "\n".join(f"--- {where} ---\n{tail(log)}" for where, _, log in self.running)

    async def stop(self) -> list[str]:
        """SIGTERM everything still running, newest first; each must stop cleanly: exit 0,
        or end by the signal after its own clean shutdown (uvicorn re-raises it)."""
        problems = []
        for where, proc, log in reversed(self.running):
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
            try:
                code = await asyncio.wait_for(proc.wait(), 20)
            except TimeoutError:
                proc.kill()
                code = await proc.wait()
                problems.append(f"{where} did not stop on SIGTERM:\n{tail(log)}")
                continue
            if code not in (0, -signal.SIGTERM):
                problems.append(f"{where} exited {code} on SIGTERM:\n{tail(log)}")
        return problems


async def live(client: Client, capability: str) -> int:
    if not capability or capability.startswith("http"):
        return 0
    records = await client.agents()  # task capabilities too: they are not routed
    return sum(
        1
        for r in records
        if r.status.value == "UP"
        and capability in {c.name for c in [*r.info.capabilities, *r.info.tasks]}
    )


def tail(log: Path, lines: int = 40) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no output)"


@pytest.mark.parametrize("page", run_pages(), ids=page_id)
async def test_samples_run(page: Path, nats_server: NatsServer, tmp_path: Path) -> None:
    blocks = [b for b in read_blocks(page) if runnable(b)]
    if not blocks:
        pytest.skip("every block of this page is marked norun")
    need_shell_tools(blocks)
    settings = ReachSettings(nats_url=nats_server.url, subject_prefix=unique_prefix())
    run = Page(page, settings, tmp_path)
    problems: list[str] = []
    try:
        async with Registry(settings=settings), Client(settings=settings) as client:
            for block in blocks:
                await run.run_block(block, client)
    finally:
        problems = await run.stop()
    assert not problems, "\n".join(problems)


def need_shell_tools(blocks: list[Block]) -> None:
    """bash and curl, before a page starts (skipped without them, naming how to install)."""
    shell = [b for b in blocks if b.lang in SHELL_RUN]
    if shell:
        need("bash", "apt-get install bash")
    if any(CURL.search(b.code) for b in shell):
        need("curl", "apt-get install curl")


async def test_a_shell_sample_fails_on_an_http_error(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """The runner's promise for shell blocks: ``curl -s`` as a sample types it fails the
    block on an HTTP error (here 401: no token), on the page's port, with the page's token."""
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- run: gateway token=TOKEN -->\n```bash\n"
        'curl -s -H "Authorization: Bearer $TOKEN" localhost:8080/v1/capabilities\n```\n\n'
        "<!-- run: gateway -->\n```bash\ncurl -s localhost:8080/v1/capabilities\n```\n",
        encoding="utf-8",
    )
    with_token, without = read_blocks(page)
    need_shell_tools([with_token, without])
    settings = ReachSettings(nats_url=nats_server.url, subject_prefix=unique_prefix())
    (tmp_path / "run").mkdir()
    run = Page(page, settings, tmp_path / "run")
    try:
        async with Registry(settings=settings), Client(settings=settings) as client:
            await run.run_block(with_token, client)
            with pytest.raises(pytest.fail.Exception, match=r"page.md:7 exited 22"):
                await run.run_block(without, client)
    finally:
        assert not await run.stop()
    assert '"error"' in (tmp_path / "run" / "block-7.log").read_text()  # the body is shown


# -- what the pages link to and what the compose file needs ---------------------------------


def test_readme_is_short_and_its_links_exist() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) < 250
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    missing = [t for t in targets if "://" not in t and not (ROOT / t).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"


#: what a user doc must not say: our issue numbers (``issue 20``, a bare ``#20``; an
#: upstream ``owner/repo#8274`` is a reference a reader can follow) and review history
HISTORY = re.compile(
    r"\bissues?\s+#?\d+"
    r"|(?<![\w/.&-])#\d+\b"
    r"|\b(?:after|before) the (?:\w+ )?(?:review|changes above)\b"
    r"|\breview(?:'s|s') fixes\b|\breview history\b|\bas first planned\b|\bwhat changed:",
    re.IGNORECASE,
)


def test_user_docs_name_no_issues_or_review_history() -> None:
    """The docs say what the code does now, not how it got there."""
    found = [
        f"{page.relative_to(ROOT)}:{n}: {m[0]!r}"
        for page in PAGES
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
        for m in HISTORY.finditer(line)
    ]
    assert not found, "\n".join(found)


def compose_variables(node: object) -> set[str]:
    """Variables docker-compose.yml interpolates without a default (``${X}``, ``${X:?..}``)."""
    found: set[str] = set()
    if isinstance(node, dict):
        for key, value in node.items():
            found |= compose_variables(key) | compose_variables(value)
    elif isinstance(node, list):
        for item in node:
            found |= compose_variables(item)
    elif isinstance(node, str):
        text = node.replace("$$", "")
        for name, modifier in re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(:?[-?+]?)", text):
            if "-" not in modifier and "+" not in modifier:
                found.add(name)
        found |= set(re.findall(r"\$([A-Za-z_][A-Za-z0-9_]*)", re.sub(r"\$\{[^}]*\}", "", text)))
    return found


def test_env_example_names_every_variable_compose_requires() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text(encoding="utf-8"))
    required = compose_variables(compose)
    assert "GATEWAY_TOKEN" in required  # the parser sees the file's own variables
    example = (ROOT / ".env.example").read_text(encoding="utf-8")
    named = set(re.findall(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*=", example, re.MULTILINE))
    missing = sorted(required - named)
    assert not missing, f".env.example does not name {missing}, which docker-compose.yml needs"


def test_every_setting_is_documented() -> None:
    text = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    missing = [
        f"REACH_{f.upper()}" for f in ReachSettings.model_fields if f"REACH_{f.upper()}" not in text
    ]
    assert not missing, f"docs/configuration.md does not list {missing}"
