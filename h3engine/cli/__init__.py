"""The command line: `main` (generate, serve and the tools), the validation kit in `validation`."""
