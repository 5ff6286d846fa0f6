"""Tests of derecho_async.config: validation, host:port, tuning keys, and the sources (TOML,
environment, precedence); each names the key and the source of a bad value."""
