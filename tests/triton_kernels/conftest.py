import os, torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
