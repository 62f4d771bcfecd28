"""A bad setting is one line from the ``reach`` command: the variable, what is wrong, and
(for a value of the wrong shape) one that is right; never pydantic's report, its link, or
the value given (a token, a password). The gateway's and ``reach mcp --http``'s own
settings (``REACH_GATEWAY_*``) as well as ``REACH_*``, each a usage error (exit 2)."""

from __future__ import annotations

import pytest

from reach.cli import main

SECRET = "s3cret-tok"  # too short to be a token: refused, and never printed


@pytest.fixture(autouse=True)
def _no_dotenv(tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no .env of the repository's


@pytest.mark.parametrize("command", [["gateway", "--port", "0"], ["mcp", "--http"]])
@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("short", "REACH_GATEWAY_TOKENS: not valid JSON (Expecting value"),
        (f'["{SECRET}"]', "REACH_GATEWAY_TOKENS: Input should be a valid dictionary; e.g."),
        (f'{{"{SECRET}": "call"}}', "REACH_GATEWAY_TOKENS: Input should be a valid frozenset"),
        (f'{{"{SECRET}": ["call"]}}', "REACH_GATEWAY_TOKENS: every token must be at least 16"),
        (f'{{"{SECRET * 2}": ["nope"]}}', "REACH_GATEWAY_TOKENS: Input should be 'call', 'submit'"),
        (f'{{"{SECRET * 2}": []}}', "REACH_GATEWAY_TOKENS: every token needs at least one scope"),
    ],
)
def test_bad_gateway_tokens_are_one_line_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: list[str],
    value: str,
    says: str,
) -> None:
    monkeypatch.setenv("REACH_GATEWAY_TOKENS", value)
    assert main(command) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: bad_request: invalid settings: ")
    assert says in err
    assert len(err.strip().splitlines()) == 1, err
    assert "pydantic" not in err
    assert SECRET not in err
    if "e.g." in says:
        assert """e.g. REACH_GATEWAY_TOKENS='{"<token""" in err


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        (
            "REACH_GATEWAY_MAX_BODY_BYTES",
            "1MB",
            "REACH_GATEWAY_MAX_BODY_BYTES: Input should be a valid integer",
        ),
        ("REACH_GATEWAY_MAX_STREAMS", "0", "REACH_GATEWAY_MAX_STREAMS: Input should be greater"),
    ],
)
def test_every_gateway_setting_is_explained_so(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    variable: str,
    value: str,
    says: str,
) -> None:
    monkeypatch.setenv(variable, value)
    assert main(["gateway", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert says in err
    assert len(err.strip().splitlines()) == 1, err
    assert "pydantic" not in err


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        (
            "REACH_RATE_LIMITS",
            "fast",
            "REACH_RATE_LIMITS (rate_limits): not valid JSON (Expecting value: line 1 column 1"
            """ (char 0)); e.g. REACH_RATE_LIMITS='{"text.translate": [50, 100]}'""",
        ),
        (
            "REACH_RATE_LIMITS",
            '{"text.translate": 3}',
            "REACH_RATE_LIMITS (rate_limits) at 'text.translate': Input should be a valid tuple;"
            """ e.g. REACH_RATE_LIMITS='{"text.translate": [50, 100]}'""",
        ),
        ("REACH_TIMEOUT_MS", "0", "REACH_TIMEOUT_MS (timeout_ms): Input should be greater than 0"),
    ],
)
def test_reach_settings_name_the_variable_and_the_file_key(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    variable: str,
    value: str,
    says: str,
) -> None:
    monkeypatch.setenv(variable, value)
    assert main(["agents"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: bad_request: invalid settings: {says}\n"
