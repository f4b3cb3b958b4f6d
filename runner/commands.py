"""Generation commands of the CLI: run and chat."""
