import sys

from h3engine.cli import main

sys.exit(main())
