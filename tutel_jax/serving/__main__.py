"""`python -m tutel_jax.serving CHECKPOINT ...`: the same server as `tutel-jax serve`."""

import sys

from ._server import main

sys.exit(main())
