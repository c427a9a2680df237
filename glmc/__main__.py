import sys

from glmc.cli import main

sys.exit(main())
