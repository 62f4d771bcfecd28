"""The benches' child processes: stopped however a start ends, on the defaults whatever the
shell exports."""

import os
import sys
from pathlib import Path

import pytest

from reach import ReachSettings

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def fleet(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # children inherit the path and import it too
    import _fleet

    return _fleet


def never_ready(ready, stop) -> None:
    stop.wait()


def exits_early(ready, stop) -> None:
    sys.exit(3)


def report_environment(out, ready, stop) -> None:
    out.put(sorted(k for k in os.environ if k.startswith("REACH_")))
    ready.set()
    stop.wait()


def kill_leftovers(children) -> None:
    for proc in children.procs:
        if proc.is_alive():
            proc.kill()
            proc.join()


def test_a_child_that_never_gets_ready_is_stopped_when_the_start_fails(fleet):
    children = fleet.Children(ready_timeout=0.2, stop_timeout=10)
    children.add(never_ready)
    try:
        with pytest.raises(RuntimeError), children:
            pass
        assert [proc.is_alive() for proc in children.procs] == [False]
        assert all(proc.daemon for proc in children.procs)
    finally:
        kill_leftovers(children)


def test_a_child_that_dies_before_it_is_ready_fails_the_start_at_once(fleet):
    children = fleet.Children(ready_timeout=120, stop_timeout=10)
    children.add(exits_early)
    children.add(never_ready)
    try:
        with pytest.raises(RuntimeError, match="exited with 3"), children:
            pass
        assert children.procs[1].pid is None  # never started after the first failed
    finally:
        kill_leftovers(children)


def test_children_and_their_settings_ignore_reach_variables(fleet, monkeypatch, tmp_path):
    monkeypatch.setenv("REACH_ROUTING", "queue")
    monkeypatch.setenv("REACH_MAX_QUEUE", "1")
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_text("REACH_TIMEOUT_MS=1\n")
    settings = fleet.defaults("nats://127.0.0.1:4999", "bench", lease_ttl=600.0)
    assert (settings.nats_url, settings.subject_prefix, settings.lease_ttl) == (
        "nats://127.0.0.1:4999",
        "bench",
        600.0,
    )
    for name, field in ReachSettings.model_fields.items():
        if name not in ("nats_url", "subject_prefix", "lease_ttl"):
            assert getattr(settings, name) == field.get_default(call_default_factory=True), name

    children = fleet.Children(ready_timeout=60, stop_timeout=10)
    out = children.queue()
    children.add(report_environment, out)
    try:
        with children:
            assert out.get(timeout=30) == []
    finally:
        kill_leftovers(children)
