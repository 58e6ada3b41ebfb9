"""The decode loop: `state` (what a round carries), `round` (draft -> verify -> advance, chain or
tree), `decode` (the jitted `lax.while_loop`), `stream` (the same round, one host step at a time),
`generate` (plain decoding, the reference)."""
