"""`specjax audit` on the shipped head pair: PASS with the exact rule, FAIL with a broken one.

The pair is "smollm2-head" (the EAGLE-3 head behind prompt lookup), put in place of the CLI's
default pair. The default (`load_default()`) drafts with the target's own 4-bit copy, whose
weights are the target's: there q equals p to float rounding, a rule that skips the residual
changes nothing measurable, and the negative control cannot be rejected at any practical
sample size.

Seeded (seed 0), 4 default prompts x 1,000 sampled continuations, first 3 positions, temperature
0.8, family-wise alpha 1e-3 with Bonferroni over the 12 position tests. Measured when this test was
written: the exact rule's smallest p-value was 0.023; the rule that skips the residual was rejected
at p = 9.8e-14. That rule is the audit's negative control, run on the same draws, so the PASS
includes its rejection (the power check).
"""

import functools

import pytest

import specjax as sj
from specjax.cli import main as cli
from specjax.testing.rules import rule_without_residual

pytestmark = pytest.mark.slow  # about a minute of CPU per audit

ARGS = ["audit", "--samples", "1000", "--temperature", "0.8"]


@pytest.fixture(autouse=True)
def head_pair(monkeypatch):
  """The CLI's default pair (`sj.load_default()`, read by `specjax.cli.pair_args.load_pair`) is
  the head pair in these tests."""
  monkeypatch.setattr(sj, "load_default", lambda: sj.load_pair("smollm2-head"))


def test_audit_passes_on_the_shipped_pair(capsys):
  assert cli.main(ARGS) == 0
  report = capsys.readouterr().out
  assert report.startswith("specjax exactness audit: PASS")
  assert "decode equals generate on all" in report
  assert "the broken control rule is rejected on the same draws" in report


def test_audit_fails_on_the_shipped_pair_with_a_broken_rule(capsys, monkeypatch):
  broken = functools.partial(sj.audit, verify_impl=rule_without_residual)
  monkeypatch.setattr(sj, "audit", broken)  # the real audit, run on a broken verify rule
  assert cli.main(ARGS) == 1
  report = capsys.readouterr().out
  assert report.startswith("specjax exactness audit: FAIL")
  assert "reject the target's distribution" in report
