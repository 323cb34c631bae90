"""`python -m pdcluster` is the `pdcluster` console script."""

import sys

from pdcluster.cli import main

sys.exit(main())
