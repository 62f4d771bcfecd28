"""A settings file (REACH_CONFIG or ``reach --config``): its place in the precedence, and one
clear line for every way it can be wrong."""

from __future__ import annotations

import os
import sys

import pytest

from reach import ConfigurationError, ReachSettings
from reach._cli_gateway import _worker_argv
from reach.cli import _settings, build_parser, main


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    for var in list(os.environ):
        if var.startswith("REACH_"):
            monkeypatch.delenv(var)
    monkeypatch.chdir(tmp_path)


TOML = 'timeout_ms = 1111\nmax_queue = 7\nrate_limits = { "a.b" = [5.0, 10.0] }\n'
YAML = "timeout_ms: 1111\nmax_queue: 7\nrate_limits:\n  a.b: [5.0, 10.0]\n"


@pytest.mark.parametrize(("name", "text"), [("reach.toml", TOML), ("reach.yaml", YAML)])
def test_the_file_is_over_the_defaults(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    s = ReachSettings(config=name)
    assert (s.timeout_ms, s.max_queue, s.rate_limits) == (1111, 7, {"a.b": (5.0, 10.0)})
    assert s.subject_prefix == "reach"  # what it does not name keeps its default


def test_precedence_arguments_over_env_over_dotenv_over_file_over_defaults(monkeypatch, tmp_path):
    (tmp_path / "reach.toml").write_text(
        "timeout_ms = 1111\nmax_queue = 7\nmax_attempts = 4\nretry_cap = 9.0\n"
    )
    monkeypatch.setenv("REACH_CONFIG", "reach.toml")
    s = ReachSettings()
    assert (s.timeout_ms, s.max_queue, s.max_attempts, s.retry_cap) == (1111, 7, 4, 9.0)
    (tmp_path / ".env").write_text("REACH_RETRY_CAP=8.0\nREACH_MAX_ATTEMPTS=5\n")
    s = ReachSettings()
    assert (s.timeout_ms, s.max_queue, s.max_attempts, s.retry_cap) == (1111, 7, 5, 8.0)
    monkeypatch.setenv("REACH_MAX_ATTEMPTS", "6")
    monkeypatch.setenv("REACH_TIMEOUT_MS", "2222")
    s = ReachSettings()
    assert (s.timeout_ms, s.max_queue, s.max_attempts, s.retry_cap) == (2222, 7, 6, 8.0)
    s = ReachSettings(timeout_ms=3333)
    assert (s.timeout_ms, s.max_queue, s.max_attempts, s.retry_cap) == (3333, 7, 6, 8.0)
    assert ReachSettings(config="").timeout_ms == 2222  # an argument turns the file off
    assert ReachSettings(config="").max_queue == 64


def test_the_command_line_file_is_over_reach_config(monkeypatch, tmp_path):
    (tmp_path / "env.toml").write_text("max_queue = 7\n")
    (tmp_path / "cli.toml").write_text("max_queue = 9\n")
    monkeypatch.setenv("REACH_CONFIG", "env.toml")
    args = build_parser().parse_args(["agents"])
    assert _settings(args).max_queue == 7
    args = build_parser().parse_args(["--config", "cli.toml", "agents", "--url", "nats://h:1"])
    s = _settings(args)
    assert (s.max_queue, s.nats_url, s.config) == (9, "nats://h:1", "cli.toml")
    # `reach up --config` is still the nats-server config: the two do not mix
    args = build_parser().parse_args(["--config", "cli.toml", "up", "--config", "nats.conf"])
    assert (args.settings_file, args.config) == ("cli.toml", "nats.conf")


def test_gateway_workers_read_the_same_file():
    args = build_parser().parse_args(["--config", "cli.toml", "gateway"])
    argv = _worker_argv(args, "127.0.0.1", 8080, None, 0)
    assert argv[:5] == [sys.executable, "-m", "reach.cli", "--config", "cli.toml"]
    assert argv[5] == "gateway"


@pytest.mark.parametrize(
    ("name", "text", "says"),
    [
        ("missing.toml", None, "missing.toml: no such file; fix the path in REACH_CONFIG"),
        ("reach.toml", "max_qeue = 3\n", "unknown setting 'max_qeue'; did you mean 'max_queue'?"),
        ("reach.yaml", "nats_ulr: nats://h:1\n", "did you mean 'nats_url'?"),
        ("reach.toml", 'config = "other.toml"\n', "unknown setting 'config'"),
        ("reach.toml", "timeout_ms = \n", "not valid TOML"),
        ("reach.yaml", "timeout_ms: [1,\n", "not valid YAML"),
        ("reach.yaml", "- 1\n- 2\n", "must hold a mapping"),
        ("reach.json", "{}", "use a .toml or .yaml file"),
        ("reach.toml", b"\xff\xfe", "cannot be read (not UTF-8 text)"),
    ],
)
def test_a_bad_file_is_one_line_saying_what_to_fix(tmp_path, name, text, says):
    if isinstance(text, bytes):
        (tmp_path / name).write_bytes(text)
    elif text is not None:
        (tmp_path / name).write_text(text)
    with pytest.raises(ConfigurationError) as info:
        ReachSettings(config=name)
    assert says in str(info.value)
    assert "\n" not in str(info.value)


def test_a_directory_is_not_a_file(tmp_path):
    (tmp_path / "conf.toml").mkdir()
    with pytest.raises(ConfigurationError, match=r"conf\.toml: cannot be read \(Is a directory\)"):
        ReachSettings(config="conf.toml")


def test_yaml_without_pyyaml_says_how_to_get_it(monkeypatch, tmp_path):
    (tmp_path / "reach.yaml").write_text("max_queue: 7\n")
    monkeypatch.setitem(sys.modules, "yaml", None)  # as if PyYAML were not installed
    with pytest.raises(ConfigurationError, match=r"YAML needs PyYAML \(pip install pyyaml\)"):
        ReachSettings(config="reach.yaml")


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("max_qeue = 3\n", "error: bad_request: settings file bad.toml: unknown setting"),
        (
            "timeout_ms = 0\n",
            "error: bad_request: invalid settings: REACH_TIMEOUT_MS (timeout_ms): Input should be",
        ),
        ('nats_password = "pw"\nlease_ttl = 1.0\n', "lease_ttl (1s) must be at least 2 x"),
    ],
)
def test_the_reach_command_says_it_in_one_line(tmp_path, capsys, text, says):
    (tmp_path / "bad.toml").write_text(text)
    assert main(["--config", "bad.toml", "agents"]) == 2
    err = capsys.readouterr().err
    assert says in err
    assert len(err.strip().splitlines()) == 1
    assert "Traceback" not in err
    assert '"pw"' not in err
