"""The package index: one client for reading simple pages (credentials included), the static index writer, uploads."""
