"""Under CI=true a skipped test fails, unless its reason names hardware CI cannot have."""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import Any

import pytest

CI_ALLOWED_SKIP_WORDS = ("GPU", "CUDA", "NCCL")
"""The one allow-list: a skip reason naming one of these (case-sensitive) needs an accelerator;
any other skip in CI means something `make setup` installs is missing or broken."""


def allowed(reason: str) -> bool:
    return any(word in reason for word in CI_ALLOWED_SKIP_WORDS)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI") != "true" or not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if not allowed(reason):
        report.outcome = "failed"
        words = ", ".join(CI_ALLOWED_SKIP_WORDS)
        report.longrepr = (
            f"skipped under CI=true: {reason} (only skips naming {words} may pass in CI; see "
            "tests/ci_skips.py)"
        )
