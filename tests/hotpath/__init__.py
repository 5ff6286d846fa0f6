"""The native hot path (derecho_async._native) against its pure-Python twin, one test module
per concern of ``derecho_async/_hotpath_pure/`` (and of ``native/``), plus the selector's."""
