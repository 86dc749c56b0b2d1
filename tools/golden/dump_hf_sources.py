#!/usr/bin/env python3
"""Dump the Hugging Face sources the engine must agree with (for reading, not copying)."""
import inspect, sys, os
import transformers
from transformers import modeling_rope_utils
from transformers.models.deepseek_v2 import modeling_deepseek_v2
from transformers.models.deepseek_v3 import modeling_deepseek_v3
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
for name, mod in [("rope_utils.py", modeling_rope_utils), ("deepseek_v2.py", modeling_deepseek_v2),
                  ("deepseek_v3.py", modeling_deepseek_v3)]:
    open(os.path.join(out, name), "w").write(inspect.getsource(mod))
