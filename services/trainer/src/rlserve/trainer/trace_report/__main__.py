"""`python -m rlserve.trainer.trace_report FILE...`: `rlserve trace report` without the
command's entry point."""

import sys

from rlserve.trainer.trace_report import main

sys.exit(main())
