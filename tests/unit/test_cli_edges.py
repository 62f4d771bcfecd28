"""The command line's input edges without a server: payload arguments (JSON, ``-`` for
stdin, ``@FILE``), options in any case, a task id where a dead letter's SEQ is wanted, what
the first stop signal says, and the status summary's rounded milliseconds."""

import io
import signal

import pytest

from reach._cli_common import read_payload
from reach._runtime import Stopping
from reach._status.model import Counters, _Acc
from reach.cli import build_parser, main
from reach.errors import ConfigurationError


def test_a_payload_is_json_text_stdin_or_a_file(tmp_path, monkeypatch):
    assert read_payload('{"a": [1, 2]}') == {"a": [1, 2]}
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b' {"from": "stdin"}\n')))
    assert read_payload("-") == {"from": "stdin"}
    (tmp_path / "p.json").write_text('{"from": "file"}')
    monkeypatch.chdir(tmp_path)
    assert read_payload("@p.json") == {"from": "file"}
    assert read_payload(f"@{tmp_path / 'p.json'}") == {"from": "file"}


@pytest.mark.parametrize(
    ("arg", "said"),
    [
        ("@missing.json", "payload file 'missing.json' not found: give an existing file after @"),
        ("@", "@ needs a file name: @payload.json (or - for stdin)"),
        (".", "payload is not valid JSON: Expecting value: line 1 column 1 (char 0)"),
        ("@bad.json", "payload file 'bad.json' is not valid JSON: Expecting value"),
        ("@dir", "cannot read payload file 'dir': Is a directory"),
        ("@latin1.json", "payload file 'latin1.json' is not UTF-8 text"),
    ],
)
def test_a_payload_that_cannot_be_read_is_one_clear_error(tmp_path, monkeypatch, arg, said):
    (tmp_path / "bad.json").write_text("nope")
    (tmp_path / "dir").mkdir()
    (tmp_path / "latin1.json").write_bytes(b'"caf\xe9"')
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigurationError) as info:
        read_payload(arg)
    assert info.value.message.startswith(said)
    assert "\n" not in info.value.message


def test_stdin_that_is_not_json_says_it_came_from_stdin(monkeypatch):
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"{oops")))
    with pytest.raises(ConfigurationError, match=r"^the payload on stdin is not valid JSON"):
        read_payload("-")


@pytest.mark.parametrize("given", ["running", "RUNNING", "Running"])
def test_task_states_and_priorities_are_taken_in_any_case(given):
    parser = build_parser()
    assert parser.parse_args(["tasks", "--state", given]).state == "running"
    assert parser.parse_args(["call", "a.b", "--priority", "HIGH"]).priority == "high"
    assert parser.parse_args(["submit", "a.b", "--priority", "Low"]).priority == "low"


@pytest.mark.parametrize("command", [["dlq", "show"], ["dlq", "replay"]])
def test_dlq_given_a_task_id_says_it_wants_a_seq_and_where_to_find_it(command, capsys):
    with pytest.raises(SystemExit) as info:
        main([*command, "Hx9Jm1rTq2Zb3Lk4Vn5Pw6"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "'Hx9Jm1rTq2Zb3Lk4Vn5Pw6' is not a dead letter's SEQ" in err
    assert "a task id is not one" in err
    assert "'reach dlq list' shows each dead letter's SEQ" in err
    assert "Traceback" not in err


def test_the_first_stop_signal_says_how_long_the_drain_may_take(capsys):
    seen = []
    stopping = Stopping(seen.append, draining="draining in-flight work for up to 30s")
    stopping(signal.SIGINT)
    assert seen == [signal.SIGINT]
    assert capsys.readouterr().err == (
        "stopping: draining in-flight work for up to 30s; press Ctrl-C again to stop now\n"
    )
    stopping(signal.SIGTERM)  # the drain is under way: a SIGTERM changes nothing
    assert seen == [signal.SIGINT]
    assert capsys.readouterr().err == ""


def test_a_sigterm_stop_says_it_without_the_ctrl_c_hint(capsys):
    seen = []
    Stopping(seen.append, draining="draining in-flight work for up to 5s")(signal.SIGTERM)
    assert seen == [signal.SIGTERM]
    assert capsys.readouterr().err == "stopping: draining in-flight work for up to 5s\n"


def test_the_status_summary_rounds_its_latency():
    acc = _Acc()
    acc.add(Counters(requests=3, errors=0, processing_ns=1_000_001_000), 1.0)
    assert acc.traffic().latency_ms == 333.334


def test_reach_up_port_0_is_any_free_port_as_on_the_gateway(capsys):
    args = build_parser().parse_args(["up", "--port", "0", "--monitor-port", "0"])
    assert (args.port, args.monitor_port) == (-1, -1)  # nats-server's own 0 means 4222
    assert build_parser().parse_args(["up", "--port", "-1"]).port == -1
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--port", "70000"])
    assert "70000 is not a port" in capsys.readouterr().err


def test_bad_usage_is_one_line_naming_the_problem_and_the_help(capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["up", "--port", "70000"])
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "reach up: error: argument --port: 70000 is not a port (1-65535, or 0 for any)"
        " (see reach up --help)"
    ]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["nosuch"])
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("reach: error: argument command: invalid choice: 'nosuch'")
