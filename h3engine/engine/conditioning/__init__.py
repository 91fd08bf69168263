"""A request's conditions: its prompt, keyframes and references, read and encoded for the DiT."""
