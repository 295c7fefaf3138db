"""What the runner shares with the pytest plugin it loads into vLLM's test run.

The tool imports this module, never the plugin itself: the plugin imports pytest, which only
the test environment (and the tool's test extra) has. The plugin repeats these names because
it is copied alone into the run; ``tests/unit/test_suite.py`` asserts both agree.
"""

from __future__ import annotations

from pathlib import Path

PLUGIN_FILE = Path(__file__).with_name("plugin.py")
DIR_ENV = "VLLM_OVERLAY_SUITE_DIR"
HARD_TIMEOUT_ENV = "VLLM_OVERLAY_SUITE_HARD_TIMEOUT"
DESELECT_ENV = "VLLM_OVERLAY_SUITE_DESELECT"
DESELECTED = "deselected.txt"
MARKERS_PROPERTY = "vllm_overlay.markers"
COLLECTED = "collected.txt"
PROGRESS = "progress.json"
HANG_PREFIX = "hang-"
