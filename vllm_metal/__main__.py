"""`python -m vllm_metal doctor` runs the `vllm-metal` command."""

import sys

from vllm_metal.doctor.cli import main

sys.exit(main())
