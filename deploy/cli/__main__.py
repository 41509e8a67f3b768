"""`python -m deploy.cli`: the `specfleet` command."""

import sys

from deploy.cli.main import main

sys.exit(main())
