"""Tool costs on the calculator task: tool use on easy and hard problems before and after GRPO from calc-base,
with and without a per-call cost, and per-turn credit against final-reward credit.

    python benchmarks/tool_costs_calc.py [--tool-cost 0.1] [--max-steps 120] [--val-n 500]
                                         [--arms none,final,turn-final,turn] [--easy-share 0.5] [--quick]

Runs ``time_to_accuracy_calc.py --compare-costs``: the arms train from calc-base on the same seed for the same
number of GRPO steps (the step cap, not a time budget, so the figures do not depend on the machine's speed):
no cost; cost in the final reward; cost per turn with final-reward credit (which cannot see the cost: the
control for per-turn credit); cost per turn with per-turn ``returns`` credit. Half of
each step's problems are easy (``--easy-share 0.5``; the train split has 7%): with 1 easy problem in 16, the
hard ones, which all favour calling, drown the easy ones' signal and the policy calls on everything. It
prints, per arm, greedy tool use and accuracy on easy (``add``) and hard problems before -> after, the arm's
final greedy accuracy minus the no-cost arm's, and one verdict line per costed arm. Any other flag goes to
``time_to_accuracy_calc.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import time_to_accuracy_calc


def main() -> int:
    args = sys.argv[1:]
    defaults = {
        "--tool-cost": "0.1",
        "--max-steps": "120",
        "--seconds": "3600",
        "--val-n": "500",
        "--eval-every": "20",
        # turn-final vs turn: the same per-turn cost, credited by the final reward alone or per turn
        "--arms": "none,final,turn-final,turn",
        "--easy-share": "0.5",
    }
    if "--quick" in args:
        defaults = {"--tool-cost": "0.1", "--arms": "none,final", "--easy-share": "0.5"}
    for flag, value in defaults.items():
        if flag not in args:
            args += [flag, value]
    sys.argv = [sys.argv[0], "--compare-costs", *args]
    return time_to_accuracy_calc.main()


if __name__ == "__main__":
    sys.exit(main())
