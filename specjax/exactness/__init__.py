"""`specjax.audit`: an empirical check that a decode configuration samples the target's
distribution (`audit` runs it, `stats` holds the goodness-of-fit tests, `report` the result,
`AuditReport`)."""

from specjax.exactness.report import AuditReport

__all__ = ["AuditReport"]
