"""The command line over the runtime: `streamfuse generate` (generate), the flags every entry point shares
(options) and one-line errors (errors)."""
