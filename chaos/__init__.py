"""Chaos harness for pgoutbox (`make chaos`); see harness.py."""
