#!/usr/bin/env python3
"""Write a random-weight Hugging Face checkpoint with a real model's shapes (speed work without
the real weights). See `python scripts/make_synthetic_model.py --help` and qpalette.models.synthetic."""

import sys

from qpalette.models.synthetic import main

if __name__ == "__main__":
    sys.exit(main())
