#!/usr/bin/env python3
"""Where transformers' `generate` spends host time per decode step (qpalette.measure.host_profile):

    python scripts/profile_generate.py MODEL_DIR [MODEL_DIR ...] --out DIR [--batch 1] [--prompt-len 16]
        [--gen-len 32] [--compile-modes default,lean]
"""

from qpalette.measure.host_profile import main

if __name__ == "__main__":
    main()
