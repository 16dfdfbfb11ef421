"""Task metrics, in percent (0-100): the one ROUGE recipe, corpus BLEU (E2E NLG) and SQL exact match, below both the
build (export/) and the benchmark (tools/)."""
