"""``python -m scalerlt_mcore.plan``: does a run fit its GPUs? (see ``scalerlt_mcore.app.plan``)."""

import sys

from scalerlt_mcore.app.plan import main

if __name__ == "__main__":
    sys.exit(main())
