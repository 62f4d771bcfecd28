"""The heartbeat interval a registry offers is used only when it is sane."""

import math

import pytest

from reach._agent.presence import accept_interval


@pytest.mark.parametrize(
    ("offered", "used"),
    [
        (0.5, 0.5),
        (2.0, 1.0),  # never slower than our own setting
        (0.05, 0.05),
        (0.0, 1.0),  # would flood the registry
        (-1.0, 1.0),
        (0.001, 1.0),
        (math.nan, 1.0),  # would stop timed heartbeats
        (math.inf, 1.0),
    ],
)
def test_only_a_finite_interval_within_bounds_is_accepted(offered, used):
    assert accept_interval(offered, 1.0) == used
