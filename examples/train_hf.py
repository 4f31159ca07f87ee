"""Train a Hugging Face causal LM with fxpar under torchrun (the same loop as ``fxpar train``).

    torchrun --nproc_per_node 8 examples/train_hf.py llama --data synthetic --plan dp=2,pp=2,tp=2,zero=1 --steps 5
    torchrun --nproc_per_node 4 examples/train_hf.py path/to/config.json --meta --plan pp=4 --data notes.txt \
        --save ckpt --save-every 100 --export out/
"""

import sys

from fxpar.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
