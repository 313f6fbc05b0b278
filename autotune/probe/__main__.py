"""``python -m autotune.probe SPEC.json RESULT.json``: a cold probe child (``--isolation cold``).

Before the slow imports of :mod:`autotune.probe.child`: die with the driver and arm the probe's own
deadline (:mod:`autotune.probe.lifetime`), so a probe whose driver was killed cannot run on.
"""

from __future__ import annotations

import sys

from autotune.probe.lifetime import arm_deadline, die_with_parent

if __name__ == "__main__":
    die_with_parent()
    arm_deadline()
    from autotune.probe.child import main

    sys.exit(main())
