import sys

from glmc.frontend.cli import main

sys.exit(main())
