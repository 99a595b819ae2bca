"""Shared test settings: hypothesis profiles, an isolated calibration cache, a per-test timeout
(pytest-timeout, set in pyproject.toml)."""

import os
import tempfile

from hypothesis import HealthCheck, settings

os.environ.setdefault("MESHTRAIN_CACHE_DIR", tempfile.mkdtemp(prefix="meshtrain-test-cache-"))

# CI runs derandomized so a red build is reproducible; locally HYPOTHESIS_PROFILE=dev explores more.
settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=100, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
