"""`python -m mindscale.launch distribute|standalone|worker ...` (scripts/run_*.sh call this)."""
import sys

from mindscale.launch.plan import main

sys.exit(main())
