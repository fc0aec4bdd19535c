"""fastllama: one file per concern, imported as fastllama.model, fastllama.generate, ... (the package keeps
generic names such as `model` and `tokenizer` off the path of every program in the environment).

    from fastllama.generate import generate, get_tokenizer, load_model
"""

import os

# Transparent huge pages for PyTorch's CPU tensors of 2 MB or more. Its allocator reads this once, at its first
# allocation, hence here, before the package's modules import torch. A decode step streams every weight, and with
# 4 KB pages a read of a big weight waits on address translation: a model of a few GB decodes faster, for a little
# more memory (benchmarks/RESULTS.md, "Huge pages for the weights"). THP_MEM_ALLOC_ENABLE=0 in the environment keeps
# PyTorch's default.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
