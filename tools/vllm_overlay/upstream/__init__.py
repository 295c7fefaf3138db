"""Sending a change of ours upstream: the commit as upstream would take it, proven."""
