"""Chaos harness for pgoutbox (`make chaos`); see harness.py.

The hostile inputs (poison.py) live here, not under tests/: the harness and
the tests import them under the one name `chaos.poison` (the checkout's root
is on the tests' path), so a process that does both loads the module once.
"""
