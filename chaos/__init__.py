"""Provoke every failure on purpose: real processes, real SIGKILLs, invariants checked after."""
