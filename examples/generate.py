#!/usr/bin/env python3
"""Generate from an HF MoE checkpoint: the `tutel-jax generate` command as a script.

    python examples/generate.py tests/fixtures/hf/qwen3_moe --ids 5,17,42,7 --ids 9,3 --max-new-tokens 8
    python examples/generate.py CHECKPOINT --prompt "Once upon a time" --eos --stream   # needs tokenizer.json
"""

import sys

from tutel_jax.serving import generate_main as main

if __name__ == "__main__":
    sys.exit(main())
