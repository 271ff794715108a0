"""Helpers shared by the tests of every side (no tests here)."""
