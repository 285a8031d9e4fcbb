"""`python -m rolloutdb ...` runs the `rolloutdb` command."""

import sys

from rolloutdb.cli import main

sys.exit(main())
