"""Tests across simulated hosts (meshtrain/simhosts.py): one torchrun per host, in Linux namespaces."""
