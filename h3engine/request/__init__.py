"""What a user asks for and its rules: `model` (the request), `validate` and `file_rules`, `geometry` and `limits`;
the one resolve on a checkpoint is h3engine.engine.resolved."""
