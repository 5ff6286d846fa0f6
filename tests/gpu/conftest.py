"""GPU tests: collected everywhere, skipped with the reason where no GPU is available."""
