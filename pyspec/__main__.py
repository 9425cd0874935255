import sys

from pyspec.cli import main

sys.exit(main())
