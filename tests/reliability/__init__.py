"""Reliability: every bad input gives a clear error, a non-zero exit, no partial files, no hang."""
