"""Benchmarks (``meshtrain bench ...``): they print tables, write JSON/PNG, and compare with a peer."""
