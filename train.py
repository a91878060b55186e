"""Entry point for the older layout's ``torchrun ... train.py --job.config_file X [flags]``.

Same as ``python -m torchtitan.train``; run_train.sh uses the module form.
"""

import sys

from torchtitan.train import main

if __name__ == "__main__":
    sys.exit(main())
