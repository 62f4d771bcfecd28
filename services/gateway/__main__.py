"""Deployable gateway: ``python -m services.gateway`` is ``reach gateway`` (settings from
REACH_* and REACH_GATEWAY_*; extra arguments are passed on, e.g. ``--access-log``)."""

import sys

from reach.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["gateway", *sys.argv[1:]]))
