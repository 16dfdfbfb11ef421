"""The artifact: its format (format, files, durable writes), its manifest schema, the graph contract export and
the engines share, the ONNX external-data check, the tokenizer and the prompt format it carries."""
