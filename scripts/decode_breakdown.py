#!/usr/bin/env python3
"""Where a decode step's GPU time goes, by kernel kind (qpalette.measure.breakdown):

    python scripts/decode_breakdown.py MODEL_DIR [--batch 1] [--steps 8] [--json out.json]
"""

from qpalette.measure.breakdown import main

if __name__ == "__main__":
    main()
