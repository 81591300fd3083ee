"""``python -m bert_core.pretrain``: the script every DeepSpeed rank runs (see launch.py)."""

import sys

from bert_core.pretrain.loop import main

sys.exit(main())
