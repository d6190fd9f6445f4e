"""Helpers shared by several test suites (no tests here)."""
