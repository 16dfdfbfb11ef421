"""streamfuse footprint GENERATE-ARGS: what a process that only decodes pays for one run
of `streamfuse.runtime.commands.generate`: the runtime's import time, resident memory after the import and at the
end, the peak, the modules loaded, and which heavy ones (torch, Transformers, the training code) came in.
generate's own output is printed first; the footprint is the last line, one JSON object.

    streamfuse footprint --artifact artifacts/dialogsum --backend onnxruntime --task dialogsum \\
        --input-file ../shared/data/dialogsum/dialogsum.test.jsonl --limit 1
"""

import importlib
import json
import sys
import time

HEAVY = ("torch", "transformers", "peft", "streamfuse.adapters", "streamfuse.training", "streamfuse.export")


def resident_mib() -> dict[str, int]:
    """VmRSS and VmHWM (the peak) of this process, MiB (Linux)."""
    found = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                found[key] = int(value.split()[0]) // 1024
    return found


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    start = time.perf_counter()
    # what is timed: the runtime's import, the CLI's with it (loaded by name, as `python -m` runs it)
    errors = importlib.import_module("streamfuse.runtime.commands.errors")
    generate = importlib.import_module("streamfuse.runtime.commands.generate")

    imported, after_import = time.perf_counter() - start, resident_mib()
    start = time.perf_counter()
    status = errors.run(generate.main, argv, prog="generate")
    end = resident_mib()
    print(
        json.dumps(
            {
                "import_seconds": round(imported, 3),
                "rss_after_import_mib": after_import["VmRSS"],
                "generate_seconds": round(time.perf_counter() - start, 3),
                "rss_end_mib": end["VmRSS"],
                "peak_rss_mib": end["VmHWM"],
                "modules": len(sys.modules),
                "heavy_modules": [name for name in HEAVY if name in sys.modules],
                "status": status,
            }
        )
    )
    return status


if __name__ == "__main__":
    sys.exit(main())
