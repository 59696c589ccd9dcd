"""Linearization: a registry of rules (one module per op family) and the graph walker."""

from . import rules  # noqa: F401  (registers every rule)
from .program import Kind, LinearizedProgram, linearize
from .registry import Rule, lookup, register

__all__ = ["Kind", "LinearizedProgram", "Rule", "linearize", "lookup", "register"]
