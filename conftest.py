"""Settings shared by every package's tests (pytest loads this conftest for any test path in
the repository).

Hypothesis: under ``HYPOTHESIS_PROFILE=ci`` (the nox sessions and ``.ci/run`` set it) property
tests run derandomized and without the example database, so every run checks the same examples
and a failure found once on a developer's machine is not replayed from ``.hypothesis/`` on the
next run; explicit ``@example`` rows carry the cases worth keeping. Without the variable,
hypothesis's defaults apply (random examples, a local database).
"""

from __future__ import annotations

import os

try:
    from hypothesis import settings
except ImportError:  # a package installed without its test extra: no property tests to set up
    settings = None

if settings is not None:
    settings.register_profile("ci", database=None, derandomize=True, print_blob=True)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
