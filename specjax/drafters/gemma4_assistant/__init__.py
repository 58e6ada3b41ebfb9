"""Gemma 4 assistant drafters (`gemma4_assistant`): `network` (the published architecture: queries
only, attending the target's keys and values), `drafter` (`Gemma4AssistantDrafter`, a chain),
`checkpoint` (`load_gemma4_assistant`, the published layout)."""
