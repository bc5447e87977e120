"""`python -m lmserve.cli`: the `lmserve` command (tests and scripts start servers this way)."""

import sys

from lmserve.cli import main

sys.exit(main())
