"""Parallelism over a Mesh: data parallel, ZeRO, and (later) tensor, context and pipeline."""
