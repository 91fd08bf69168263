"""What a user asks for and its rules: `model` (the request), `validate`, `resolved` (the one checker)."""
