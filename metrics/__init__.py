"""Task metrics, in percent (0-100): the one ROUGE recipe and SQL exact match, below both the build
(export/) and the benchmark (tools/)."""
