import sys

from ._report import main

sys.exit(main())
