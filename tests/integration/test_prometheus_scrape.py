"""A real Prometheus (Debian's binary) on loopback scrapes Reach's /metrics, loads the shipped
alert rules, and answers every dashboard query through its HTTP API.

Without Prometheus this test is skipped, saying how to install it; CI installs the
`prometheus` package in .ci/run and sets REACH_REQUIRE_TOOLS=1, which makes it fail instead.
"""

import asyncio
import json
import re
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

import reach
from reach.telemetry import Telemetry
from reach.testing import eventually

from ..observability import (
    PROMETHEUS_DIR,
    alert_rules,
    dashboard,
    dashboard_exprs,
    emit_catalogue,
    substitute,
    tool,
)

_LISTENING = re.compile(r'msg="Listening on" address=127\.0\.0\.1:(\d+)')


class Prometheus:
    """``prometheus`` on 127.0.0.1 with a port of its choosing, read from its log."""

    def __init__(self, config: dict[str, Any], workdir: Path) -> None:
        self.config_path = workdir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.storage = workdir / "data"
        self.log_path = workdir / "prometheus.log"
        self.proc: asyncio.subprocess.Process | None = None
        self.port = 0

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    async def start(self) -> None:
        with self.log_path.open("wb") as log:
            self.proc = await asyncio.create_subprocess_exec(
                tool("prometheus"),
                f"--config.file={self.config_path}",
                f"--storage.tsdb.path={self.storage}",
                "--web.listen-address=127.0.0.1:0",
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )

        def listening() -> bool:
            self.check_running()
            found = _LISTENING.search(self.log())
            self.port = int(found.group(1)) if found else 0
            return bool(found)

        await eventually(listening, timeout=60)

        async def ready() -> bool:  # 503 until the TSDB is open
            self.check_running()
            url = f"http://127.0.0.1:{self.port}/-/ready"
            return await asyncio.to_thread(_status, url) == 200

        await eventually(ready, timeout=60)

    def check_running(self) -> None:
        if self.proc is None or self.proc.returncode is not None:
            raise AssertionError(f"prometheus exited:\n{self.log()}")

    async def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        proc.terminate()
        try:
            async with asyncio.timeout(30):
                await proc.wait()
        except TimeoutError:
            proc.kill()
            await proc.wait()

    async def api(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        body = await asyncio.to_thread(_get, url)
        answer = json.loads(body)
        assert answer["status"] == "success", answer
        return answer["data"]

    async def query(self, expr: str) -> list[dict[str, Any]]:
        data = await self.api("query", query=expr)
        result: list[dict[str, Any]] = data["result"]
        return result


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:
        body: bytes = response.read()
        return body


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            status: int = response.status
            return status
    except urllib.error.HTTPError as exc:
        return exc.code


def netloc(url: str) -> str:
    return urllib.parse.urlsplit(url).netloc


async def test_prometheus_scrapes_reach_and_answers_every_dashboard_query(tmp_path, reach_settings):
    # -- the Reach processes Prometheus scrapes: a real registry and agent ------------------
    registry = reach.Registry(settings=reach_settings, telemetry=Telemetry(), metrics_port=0)
    agent = reach.Agent(
        "router", "router-1", settings=reach_settings, telemetry=Telemetry(), metrics_port=0
    )

    @agent.capability("geo.route")
    async def route(req: dict[str, Any]) -> dict[str, Any]:
        return req

    await registry.start()
    await agent.start()
    assert registry.metrics_url
    assert agent.metrics_url
    processes = [netloc(registry.metrics_url), netloc(agent.metrics_url)]
    # -- every catalogue family, so that every dashboard query has data -------------------
    catalogue_telemetry = Telemetry()
    catalogue_telemetry.add_source(emit_catalogue)
    catalogue_server = await catalogue_telemetry.serve(port=0)

    prometheus = Prometheus(
        {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(PROMETHEUS_DIR / "alerts.yml")],
            "scrape_configs": [
                {"job_name": "reach", "static_configs": [{"targets": processes}]},
                {
                    "job_name": "catalogue",
                    "static_configs": [{"targets": [netloc(catalogue_server.url)]}],
                },
            ],
        },
        tmp_path,
    )
    try:
        await prometheus.start()

        async def processes_scraped() -> bool:
            series = await prometheus.query(
                'count by (__name__) ({job="reach", __name__=~"reach_.+"})'
            )
            names = {s["metric"]["__name__"] for s in series}
            return {"reach_registry_agents", "reach_agent_info"} <= names

        await eventually(processes_scraped, timeout=90)
        up = await prometheus.query('up{job="reach"}')
        assert sorted((s["metric"]["instance"], s["value"][1]) for s in up) == sorted(
            (target, "1") for target in processes
        )

        queries = [(where, substitute(e)) for where, e in dashboard_exprs(dashboard())]
        queries = [(w, e) for w, e in queries if not e.startswith("label_values(")]
        empty: list[str] = []

        async def every_panel_has_data() -> bool:
            empty[:] = [w for w, e in queries if not await prometheus.query(e)]
            return not empty

        try:
            await eventually(every_panel_has_data, timeout=90)
        except TimeoutError:
            raise AssertionError(f"no data for: {empty}") from None

        shipped = {r["alert"] for r in alert_rules()}

        async def rules_evaluated() -> bool:
            groups = (await prometheus.api("rules"))["groups"]
            rules = [r for g in groups for r in g["rules"]]
            assert [r for r in rules if r["health"] == "err"] == []
            assert {r["name"] for r in rules} == shipped
            return all(r["health"] == "ok" for r in rules)

        await eventually(rules_evaluated, timeout=90)

        async def agent_down_fires() -> bool:
            # the catalogue target reports a DOWN instance of geo.route
            alerts = (await prometheus.api("alerts"))["alerts"]
            return any(
                a["labels"]
                == {"alertname": "ReachAgentDown", "capability": "geo.route", "severity": "warning"}
                and a["state"] == "firing"
                for a in alerts
            )

        await eventually(agent_down_fires, timeout=90)
        assert catalogue_server.served > 0
    finally:
        await prometheus.stop()
        await agent.stop()
        await registry.stop()
        await catalogue_server.close()
