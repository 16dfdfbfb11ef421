"""One folder per decoding method, holding what the method is at every stage: its runtime part (`__init__.py`
declares `METHOD`, with its drafter and engine passes beside it) and, where it has them, its build part
(`build.py`: training stage, config section, export and manifest entry). runtime/methods/registry.py lists
them; runtime/methods/method.py and training/build_part.py are the protocols they declare against."""
