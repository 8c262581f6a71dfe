import sys

from hpipe.cli import main

sys.exit(main())
