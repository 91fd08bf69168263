import sys

from h3engine.cli.main import main

sys.exit(main())
