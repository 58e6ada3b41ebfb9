"""Grammar-constrained decoding: JSON Schemas and regexes as token automata on device.

`sj.constrain.json_schema(schema, tokenizer, vocab_size=model.vocab_size)` and
`sj.constrain.regex(pattern, tokenizer, vocab_size=...)` compile a grammar with outlines-core
into a `specjax.Constraint` (`specjax.constrain.compile` says why that library); its
`ConstraintTables` are fixed device arrays walked with pure jnp (`allowed_mask`, `advance`), and
`specjax.constrain.law` is the one definition of the constrained sampling law that
`sj.generate(..., constraint=)` samples from. See docs/constrain.md.
"""

from specjax.constrain.compile import DEFAULT_MAX_BYTES, Constraint, json_schema, regex
from specjax.constrain.law import (constrained_logits, constrained_probs, sample_constrained,
                                   stuck)
from specjax.constrain.tables import (DEAD, ConstraintTables, advance, allowed_mask, check_vocab,
                                      from_transitions, is_dead, mask_logits, pad_tables,
                                      stack_tables, token_allowed)
from specjax.constrain.vocabulary import token_bytes

__all__ = ["DEAD", "DEFAULT_MAX_BYTES", "Constraint", "ConstraintTables", "advance",
           "allowed_mask", "check_vocab", "constrained_logits", "constrained_probs",
           "from_transitions", "is_dead",
           "json_schema", "mask_logits", "pad_tables", "regex", "sample_constrained",
           "stack_tables", "stuck", "token_allowed", "token_bytes"]
