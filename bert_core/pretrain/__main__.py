"""``python -m bert_core.pretrain``: the script every DeepSpeed rank runs (see launch.py)."""

import os
import sys

from bert_core.pretrain.loop import main

code = main()
# Everything a rank writes is closed by now. It leaves without the interpreter's teardown, where
# the destruction of torch's native threads can abort a rank that has finished ("terminate
# called without an active exception"), which the launcher would report as a failed run.
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
