"""Errors the CLI prints as one clear message (no stack trace)."""

from __future__ import annotations


class TrainError(RuntimeError):
    """A run that cannot start or continue; the message says what and where."""


class NonFiniteError(TrainError):
    """A NaN/inf reward or loss; the run stops at that step with the samples saved."""
