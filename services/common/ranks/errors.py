"""The errors a rank group's callers see, in the project's one hierarchy."""

from __future__ import annotations

from services.common.errors import StageServeError, UnavailableError


class StepFailedError(StageServeError):
    """A step failed on some rank (the agreed error: its text names the step, the rank, the cause).

    The group stays up and serves the next step. A rank that raised a ``StageServeError``
    makes the step fail with that class instead, carrying the same agreed text.
    """


class RankStartError(UnavailableError):
    """A rank group could not form: the text names the rank, the start-up stage and the cause."""
