"""``tests.tools.need``: a missing outside tool skips the test, naming the tool and how to
install it; with ``REACH_REQUIRE_TOOLS=1`` (CI) it fails the test instead."""

import stat
from pathlib import Path

import pytest

from ..tools import REQUIRE, need


@pytest.fixture
def bin_dir(tmp_path, monkeypatch):
    """A PATH of one directory, holding only what a test puts there."""
    monkeypatch.setenv("PATH", str(tmp_path))
    return tmp_path


def executable(directory, name):
    path = directory / name
    path.write_text("#!/bin/sh\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_a_tool_on_path_is_its_path(bin_dir, monkeypatch):
    monkeypatch.setenv(REQUIRE, "1")
    found = executable(bin_dir, "promtool")
    assert need("promtool", "apt-get install prometheus") == found


def test_the_first_of_several_names_found_is_taken(bin_dir):
    found = executable(bin_dir, "chromium-browser")
    assert need(["chromium", "chromium-browser"], "apt-get install chromium") == found


@pytest.mark.parametrize("value", [None, "", "0"])
def test_a_missing_tool_skips_naming_it_and_its_install_command(bin_dir, monkeypatch, value):
    if value is None:
        monkeypatch.delenv(REQUIRE, raising=False)
    else:
        monkeypatch.setenv(REQUIRE, value)
    with pytest.raises(pytest.skip.Exception) as info:
        need("promtool", "apt-get install prometheus")
    assert str(info.value) == "promtool not found: apt-get install prometheus"


def test_with_require_tools_a_missing_tool_fails_the_test(bin_dir, monkeypatch):
    monkeypatch.setenv(REQUIRE, "1")
    with pytest.raises(pytest.fail.Exception) as info:
        need(["chromium", "google-chrome"], "apt-get install chromium")
    assert str(info.value) == (
        "chromium or google-chrome not found: apt-get install chromium"
        " (REACH_REQUIRE_TOOLS is set: CI runs every test)"
    )


def test_ci_sets_require_tools_before_the_tests():
    ci = (Path(__file__).parents[2] / ".ci" / "run").read_text()
    before_tests = ci.split("\nmake test\n")[0] + "\n"
    assert "\nexport REACH_REQUIRE_TOOLS=1\n" in before_tests
