"""python export/build.py --task dialogsum: the build's documented command, kept where users type it.

The build (data, fine-tuning, evaluation, calibration, export, profile) is streamfuse.training.build;
export/ holds the graphs, their lowering and parity, and imports nothing of the training package, so
this script hands the process over to that module with the same arguments.
"""

import os
import sys

if __name__ == "__main__":
    os.execv(sys.executable, [sys.executable, "-m", "streamfuse.training.build", *sys.argv[1:]])
