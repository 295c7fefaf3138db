"""Tracking upstream: the release outlook (where the series stands against every newer
release, from the sdists' touched files alone) and the tracking run that prepares a rebase
for review in a copy of the project."""
