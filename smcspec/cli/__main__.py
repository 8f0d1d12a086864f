"""`python -m smcspec.cli`, as `python -m smcspec` and the `smcspec` command."""

import sys

from smcspec.cli import main

sys.exit(main())
