"""The hypothesis profile CI runs under (registered by the repository's root conftest.py):
derandomized and without an example database, so no run replays an earlier run's failure."""

from __future__ import annotations

import os

from hypothesis import settings


def test_ci_profile_has_no_database_and_fixed_examples() -> None:
    ci = settings.get_profile("ci")
    assert ci.database is None and ci.derandomize
    if os.environ.get("HYPOTHESIS_PROFILE") == "ci":  # nox and .ci/run set it
        assert settings.default.database is None and settings.default.derandomize
