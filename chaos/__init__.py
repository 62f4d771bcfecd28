"""The chaos suite: break things on purpose, under load, and count what was lost.

    python -m chaos.run [--short] [--only NAME ...] [--report chaos/REPORT.md]

Uses the public ``reach`` API only. Every process runs on loopback with random ports and
is stopped by PID.
"""
