"""Tool costs on the calculator task: tool use on easy and hard problems before and after GRPO from calc-base,
with and without a per-call cost, and per-turn credit against final-reward credit.

    python benchmarks/tool_costs_calc.py [--tool-cost 0.1] [--seconds 90] [--val-n 500] [--quick]

Runs ``time_to_accuracy_calc.py --compare-costs`` (four arms on the same seed and RL budget: no cost; cost in
the final reward; cost per turn with final-reward credit; cost per turn with per-turn ``returns`` credit) and
prints, per arm, greedy tool use and accuracy on easy (``add``) and hard problems before -> after, and the
arm's final greedy accuracy minus the no-cost arm's. Any other flag goes to ``time_to_accuracy_calc.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import time_to_accuracy_calc


def main() -> int:
    args = sys.argv[1:]
    defaults = {"--tool-cost": "0.1", "--seconds": "90", "--val-n": "500", "--eval-every": "10"}
    if "--quick" in args:
        defaults = {"--tool-cost": "0.1"}
    for flag, value in defaults.items():
        if flag not in args:
            args += [flag, value]
    sys.argv = [sys.argv[0], "--compare-costs", *args]
    return time_to_accuracy_calc.main()


if __name__ == "__main__":
    sys.exit(main())
