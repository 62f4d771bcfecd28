"""What the benches share: child processes, settings from the defaults, load loops.

Benches import only the public ``reach`` API; this module is theirs (``python bench/x.py``
puts ``bench/`` on the path).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import reach
from reach.testing import eventually

Call = Callable[[], Awaitable[Any]]


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


class DefaultSettings(reach.ReachSettings):
    """ReachSettings from the defaults and the arguments only: no REACH_* variable, no .env.

    "The default path" must not mean whatever the shell exports (REACH_ROUTING=queue...).
    """

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[Any],
        init_settings: Any,
        env_settings: Any,
        dotenv_settings: Any,
        file_secret_settings: Any,
    ) -> tuple[Any, ...]:
        return (init_settings,)


def defaults(url: str, prefix: str = "reach", **kw: Any) -> reach.ReachSettings:
    """Settings from the defaults, the server URL, a prefix and ``kw``; nothing else."""
    return DefaultSettings(nats_url=url, subject_prefix=prefix, **kw)


def shown(settings: reach.ReachSettings) -> str:
    """The settings in effect, one ``name=value`` each, for a bench's setup line."""
    return ", ".join(f"{k}={v}" for k, v in settings.model_dump(mode="json").items())


def clean_environ(base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) without any REACH_* variable."""
    env = os.environ if base is None else base
    return {k: v for k, v in env.items() if not k.startswith("REACH_")}


def _child(target: Callable[..., None], args: tuple[Any, ...]) -> None:
    """A child's entry point: nothing in it may read settings from the parent's shell."""
    for key in [k for k in os.environ if k.startswith("REACH_")]:
        del os.environ[key]
    target(*args)


class Children:
    """Bench child processes, started in turn, each awaited until it sets its ready event.

    ``add(target, *args)`` runs ``target(*args, ready, stop)`` in a spawned daemon process.
    However the start or the ``with`` block ends, every child is told to stop, then killed
    if it lingers: a child that never gets ready cannot keep the bench from exiting.
    """

    def __init__(self, ready_timeout: float = 60.0, stop_timeout: float = 30.0) -> None:
        self._ctx = mp.get_context("spawn")
        self.ready_timeout = ready_timeout
        self.stop_timeout = stop_timeout
        self.stop = self._ctx.Event()
        self.procs: list[Any] = []
        self._readies: list[Any] = []

    def queue(self) -> Any:
        return self._ctx.Queue()

    def add(self, target: Callable[..., None], *args: Any) -> None:
        ready = self._ctx.Event()
        proc = self._ctx.Process(
            target=_child, args=(target, (*args, ready, self.stop)), daemon=True
        )
        self.procs.append(proc)
        self._readies.append(ready)

    def __enter__(self) -> Children:
        try:
            for proc, ready in zip(self.procs, self._readies, strict=True):
                proc.start()
                self._await_ready(proc, ready)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _await_ready(self, proc: Any, ready: Any) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while not ready.wait(0.1):
            if not proc.is_alive():
                raise RuntimeError(f"bench process {proc.name} exited with {proc.exitcode}")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"bench process {proc.name} not ready within {self.ready_timeout}s"
                )

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for proc in self.procs:
            if proc.pid is None:
                continue  # never started
            proc.join(self.stop_timeout)
            if proc.is_alive():
                proc.kill()
                proc.join()


def run_registry(url: str, ready: Any, stop: Any) -> None:
    """A child process: a registry on the defaults until told to stop."""

    async def main() -> None:
        async with reach.Registry(settings=defaults(url)):
            ready.set()
            await asyncio.get_running_loop().run_in_executor(None, stop.wait)

    asyncio.run(main())


def rounds_parser(doc: str, *, inflight: int) -> argparse.ArgumentParser:
    """The options every interleaved-rounds bench takes; ``settle`` applies ``--quick``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds x 1 s, short warm-up")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--inflight", type=int, default=inflight)
    parser.add_argument("--json", action="store_true")
    return parser


def settle(args: argparse.Namespace) -> argparse.Namespace:
    """``--quick``: 3 rounds x 1 s and a short warm-up (else 0.5 s of warm-up)."""
    args.warmup = 0.5
    if args.quick:
        args.rounds, args.seconds, args.warmup = 3, 1.0, 0.3
    return args


async def whole_fleet(client: reach.Client, n: int, capability: str = "bench.work") -> None:
    """Wait until the client's routing table holds all n instances, UP."""

    async def known() -> bool:
        records = await client.agents(capability)
        return len(records) == n and all(r.status == reach.Status.UP for r in records)

    await eventually(known, timeout=60)


async def closed_loop(fn: Call, seconds: float, inflight: int) -> tuple[float, list[float]]:
    """Requests per second and per-request latencies (ms) with ``inflight`` callers.

    The first failure cancels every caller and comes out in an ExceptionGroup: no caller
    goes on loading the server behind a failed run.
    """
    lat: list[float] = []
    end = time.perf_counter() + seconds

    async def worker() -> None:
        while (t := time.perf_counter()) < end:
            await fn()
            lat.append((time.perf_counter() - t) * 1000)

    t0 = time.perf_counter()
    async with asyncio.TaskGroup() as group:
        for _ in range(inflight):
            group.create_task(worker())
    return len(lat) / (time.perf_counter() - t0), lat


async def open_loop(fn: Call, rate: float, seconds: float) -> list[float]:
    """Latencies (ms) at a fixed offered rate, so every variant faces the same load."""
    lat: list[float] = []
    tasks: set[asyncio.Task[None]] = set()

    async def one() -> None:
        t = time.perf_counter()
        await fn()
        lat.append((time.perf_counter() - t) * 1000)

    start = time.perf_counter()
    n = 0
    while time.perf_counter() - start < seconds:
        task = asyncio.ensure_future(one())
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        n += 1
        await asyncio.sleep(max(0.0, start + n / rate - time.perf_counter()))
    await asyncio.gather(*tasks)
    return lat


# -- interleaved rounds: what a round measured, summed up and shown ---------------------------

#: per round, per variant, per number in flight (as text): messages or tasks per second
Rounds = list[dict[str, dict[str, float]]]


Latencies = dict[str, dict[str, list[float]]]


async def interleaved(
    calls: dict[str, Call],
    levels: list[int],
    rounds: int,
    seconds: float,
    *,
    runs: Callable[[str, int], bool] = lambda name, n: True,
    before: Callable[[str], Awaitable[None]] | None = None,
    after: Callable[[str, int, int], Awaitable[None]] | None = None,
    tolerated: Callable[[int, str, int, Exception], bool] = lambda r, name, n, exc: False,
) -> tuple[Rounds, Latencies]:
    """Each variant that ``runs`` at each number in flight, ``seconds`` each, once a round,
    the variants' order rotated each round (so none is always first after a change of
    level); the rates by round and every latency. ``before(name)`` runs before each run,
    ``after(name, n, calls)`` after each that ended (with how many calls it made); a
    run that raises ends the bench unless ``tolerated(round, name, n, exc)`` (then it is
    left out of that round)."""
    names = list(calls)
    per_round: Rounds = []
    lat: Latencies = {name: {} for name in names}
    for r in range(rounds):
        rates: dict[str, dict[str, float]] = {name: {} for name in names}
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in levels:
            for name in (v for v in order if runs(v, n)):
                if before is not None:
                    await before(name)
                try:
                    rate, values = await closed_loop(calls[name], seconds, n)
                except Exception as exc:
                    if not tolerated(r, name, n, exc):
                        raise
                    continue
                if after is not None:
                    await after(name, n, len(values))
                rates[name][str(n)] = rate
                lat[name].setdefault(str(n), []).extend(values)
        per_round.append(rates)
    return per_round, lat


def median_ratio(rounds: Rounds, a: str, b: str, n: str) -> float | None:
    """Median over the rounds that measured both at ``n`` in flight; None if none did."""
    values = [r[a][n] / r[b][n] for r in rounds if n in r[a] and n in r[b]]
    return statistics.median(values) if values else None


def summary(rounds: Rounds, lat: Latencies) -> dict[str, Any]:
    """Per variant and number in flight: the median rate over the rounds that measured it,
    and the p50 and p99 of every latency seen."""
    return {
        name: {
            n: {
                "rate": statistics.median(r[name][n] for r in rounds if n in r[name]),
                "p50_ms": pct(values, 0.5),
                "p99_ms": pct(values, 0.99),
            }
            for n, values in by_level.items()
        }
        for name, by_level in lat.items()
    }


def rate_table(out: dict[str, Any], unit: str) -> str:
    """``out["variants"]`` (``summary``) and ``out["ratios"]`` as a Markdown table, a rate
    column (``unit``/s) and a latency column per number in flight (``out["levels"]``)."""
    levels = [str(n) for n in out["levels"]]
    head = "| variant | " + " | ".join(f"{n} in flight {unit}/s | p50 / p99 ms" for n in levels)
    rows = [head + " |", "|---" * (1 + 2 * len(levels)) + "|"]
    for name, by_level in out["variants"].items():
        cells = []
        for n in levels:
            s = by_level.get(n)
            cells += (
                [f"{s['rate']:,.0f}", f"{s['p50_ms']:.2f} / {s['p99_ms']:.2f}"] if s else ["", ""]
            )
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    for name, by_level in out["ratios"].items():
        cells = []
        for n in levels:
            cells += [f"**{by_level[n]:.2f}x**" if by_level[n] is not None else "", ""]
        rows.append(f"| **{name}** | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def round_parser(doc: str, variants: Sequence[str]) -> argparse.ArgumentParser:
    """The options every interleaved-rounds bench takes: --quick, --rounds, --seconds,
    --inflight, --variants (of ``variants``) and --json; add more, then ``parse_rounds``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds x 1 s, short warm-up")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--inflight", type=int, default=64)
    parser.add_argument("--variants", default=",".join(variants))
    parser.add_argument("--json", action="store_true")
    return parser


def parse_rounds(parser: argparse.ArgumentParser, variants: Sequence[str]) -> argparse.Namespace:
    """The arguments, ``variants`` a list (each one known), ``warmup`` set, --quick applied."""
    args = parser.parse_args()
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(args.variants) - set(variants)
    if unknown or not args.variants:
        parser.error(f"--variants: choose among {', '.join(variants)} (got {unknown or 'none'})")
    args.warmup = 0.5
    if args.quick:
        args.rounds, args.seconds, args.warmup = 3, 1.0, 0.3
    return args


def round_setup(args: argparse.Namespace, **more: Any) -> dict[str, Any]:
    """What a rounds bench reports of how it ran: its round options, and ``more``."""
    keys = ("rounds", "seconds", "inflight", "variants")
    return {**{k: getattr(args, k) for k in keys}, **more}
