"""Testing: the CPU test environment, the suite runner and its pytest plugin, JUnit, causes, proofs."""
