"""``python -m scalerlt_mcore.engine [training flags]``: the project's decoder as a serving
engine for ``--rl-rollout-source engine`` (see ``scalerlt_mcore.app.engine``)."""

import sys

from scalerlt_mcore.app.engine import main

if __name__ == "__main__":
    sys.exit(main())
