"""`python -m grpo_hf_cli ...` is the `grpo-hf ...` console script."""

import sys

from grpo_hf_cli.main import main

sys.exit(main())
