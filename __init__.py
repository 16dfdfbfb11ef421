"""streamfuse: Speculative Streaming for on-device LLM inference (fine-tune, export, run).

Importing the package sets OMP_WAIT_POLICY=PASSIVE unless it is set: it takes effect only if it comes
before torch's OpenMP runtime loads, which every `python -m streamfuse...` entry point guarantees (the
package is imported before the module), and spin-waiting threads would otherwise steal the cores of
whatever runs next on a small CPU, distorting every timing the tools print.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
