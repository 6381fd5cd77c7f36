"""`python -m vllm_metal doctor` runs the `vllm-metal` command."""

import sys

from vllm_metal.cli import main

sys.exit(main())
