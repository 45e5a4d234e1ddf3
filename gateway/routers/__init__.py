"""One thin router per endpoint: parse, call the service, let typed errors map to status."""
