"""`python -m snrt ...`: the `snrt` command."""

import sys

from snrt.entry import main

sys.exit(main())
