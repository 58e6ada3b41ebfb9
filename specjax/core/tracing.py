"""Trace counters: how often each jitted entry point has been traced.

A recompilation guard for tests and for users who want to check that their calls stay within one
shape bucket (`specjax.core.tracing.TRACE_COUNTS["decode"]`).
"""

import collections

TRACE_COUNTS: collections.Counter = collections.Counter()
