"""``reach run MODULE:ATTR [--reload]``: serve the agent an import path names until Ctrl-C or
SIGTERM (``Agent.run``: drain, then stop). With ``--reload`` the agent runs in a child
``reach run``, restarted whenever watchfiles sees a ``.py`` file under the current directory
change (for development: the old instance drains before the new one starts).

The import path is resolved as uvicorn resolves its app: the current directory goes first on
``sys.path``, ``ATTR`` may be dotted, and it names a ``reach.Agent`` or a function that
takes no arguments and returns one (a factory)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

from ._agent import Agent
from .errors import ConfigurationError
from .settings import ReachSettings

__all__ = ["add_run_command", "load_agent"]

_FORM = "give MODULE:ATTR naming a reach.Agent or a no-argument function returning one"


def _split(target: str) -> tuple[str, str]:
    module, sep, attr = target.partition(":")
    if not (sep and module and attr) or ":" in attr:
        raise ConfigurationError(f"{target!r} is not an import path: {_FORM}")
    return module, attr


def _cwd_first() -> None:
    """The current directory first on ``sys.path``, as uvicorn puts its ``--app-dir``."""
    sys.path.insert(0, os.getcwd())


def _no_module(module: str) -> ConfigurationError:
    return ConfigurationError(
        f"no module {module!r} in {os.getcwd()} nor on sys.path: check the name, "
        "or run reach from the directory the module is in"
    )


def _is_missing(module: str, exc: ModuleNotFoundError) -> bool:
    """True when ``exc`` says ``module`` (or a package above it) is not there, not that
    something the module itself imports is missing (the module's own bug, left to raise)."""
    return exc.name is not None and (module == exc.name or module.startswith(exc.name + "."))


def _import(module: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if _is_missing(module, exc):
            raise _no_module(module) from None
        raise


def _agents_in(mod: ModuleType) -> str:
    found = [name for name, value in vars(mod).items() if isinstance(value, Agent)]
    return f" (its agents: {', '.join(found)})" if found else ""


def load_agent(target: str) -> Agent:
    """The agent ``MODULE:ATTR`` names, imported with the current directory on ``sys.path``.

    A wrong path, a missing attribute or something that is not an agent raises
    ConfigurationError with a sentence that says what to give instead; an exception the
    module raises while it is imported propagates as it is (the module's own traceback)."""
    module, attr = _split(target)
    _cwd_first()
    mod = _import(module)
    value: Any = mod
    for part in attr.split("."):
        try:
            value = getattr(value, part)
        except AttributeError:
            raise ConfigurationError(
                f"module {module!r} has no attribute {attr!r}{_agents_in(mod)}: {_FORM}"
            ) from None
    if isinstance(value, Agent):
        return value
    if not callable(value):
        kind = type(value).__name__
        raise ConfigurationError(f"{target} is a {kind}, not a reach.Agent: {_FORM}")
    try:
        inspect.signature(value).bind()
    except TypeError:
        raise ConfigurationError(
            f"{target} needs arguments, and reach run calls it with none: {_FORM}"
        ) from None
    except ValueError:
        pass  # no signature to read (a builtin): call it and look at what comes back
    made = value()
    if isinstance(made, Agent):
        return made
    if inspect.iscoroutine(made):
        made.close()
        raise ConfigurationError(f"{target} is async: make it a plain function returning the Agent")
    raise ConfigurationError(f"{target}() returned a {type(made).__name__}, not a reach.Agent")


def _check_module(target: str) -> None:
    """Fail now, not in the reloaded child, when the module cannot be found at all (its
    code is not run here: finding it imports only the packages above it)."""
    module, _ = _split(target)
    _cwd_first()
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError as exc:
        if _is_missing(module, exc):
            raise _no_module(module) from None
        raise
    if spec is None:
        raise _no_module(module)


class _Child:
    """The ``reach run`` child that serves the agent under ``--reload``, in a session of its
    own: Ctrl-C in the terminal reaches only the watcher, which stops the child with one
    SIGTERM (a drain) and gives it the drain timeout before SIGKILL."""

    def __init__(self, target: str, grace: float) -> None:
        self.command = [sys.executable, "-m", "reach.cli", "run", target]
        self.grace = grace
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, start_new_session=True)

    def signal(self, sig: signal.Signals) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)  # by PID

    def stop(self) -> None:
        if self.proc is None:
            return
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(self.grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _reload(target: str, settings: ReachSettings) -> int:
    try:
        import watchfiles
    except ImportError:
        raise ConfigurationError(
            "--reload needs watchfiles: pip install watchfiles (or 'agent-reach-nats[edge]')"
        ) from None
    _check_module(target)
    cwd = os.getcwd()
    child = _Child(target, grace=settings.drain_timeout + 1)
    stopping = threading.Event()  # watchfiles looks at it between its steps

    def on_signal(signum: int, frame: object) -> None:
        if stopping.is_set():  # Ctrl-C again: the child's to take (it stops now)
            child.signal(signal.Signals(signum))
        stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    _say(f"# reach run: watching {cwd} for .py changes")
    child.start()
    try:
        for changes in watchfiles.watch(
            cwd, watch_filter=watchfiles.PythonFilter(), stop_event=stopping
        ):
            paths = sorted({os.path.relpath(path, cwd) for _, path in changes})
            more = f" and {len(paths) - 3} more" if len(paths) > 3 else ""
            _say(f"# reach run: {', '.join(paths[:3])}{more} changed; restarting")
            child.stop()
            child.start()
    finally:
        child.stop()
    return 0


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _run(args: argparse.Namespace, settings: ReachSettings) -> int:
    if settings.config:
        # the module builds its agent's settings itself (from REACH_*): `reach --config F
        # run` must reach it, and the child that --reload starts, as REACH_CONFIG does
        os.environ["REACH_CONFIG"] = str(Path(settings.config).resolve())
    try:
        if args.reload:
            return _reload(args.target, settings)
        agent = load_agent(args.target)
    except ConfigurationError as exc:
        print(f"error: {exc.code}: {exc.message}", file=sys.stderr)
        return 2
    agent.run()
    return 0


def add_run_command(sub: Any) -> None:
    """Add ``run`` to the ``reach`` parser's subcommands."""
    p = sub.add_parser(
        "run",
        help="serve an agent from an import path (MODULE:ATTR) until Ctrl-C",
        description="Serve the reach.Agent that MODULE:ATTR names (or that the function it "
        "names returns) until Ctrl-C or SIGTERM, then drain. MODULE is imported with the "
        "current directory first on sys.path. Settings come from REACH_* as the module "
        "builds them.",
    )
    p.add_argument("target", metavar="MODULE:ATTR", help="e.g. shop.agents:agent")
    p.add_argument(
        "--reload",
        action="store_true",
        help="restart when a .py file under the current directory changes (needs watchfiles)",
    )
    p.set_defaults(run=_run, is_async=False)
