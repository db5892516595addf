"""rlhf_core against a TRL 0.11.4 baseline, test by test, from the two runs' JUnit XML reports.

    python compare.py BASELINE_JUNIT RLHF_CORE_JUNIT [LABEL]

Prints how many tests the baseline passes, how many of those rlhf_core passes (and the ratio), and the ids of the
baseline's passing tests that rlhf_core does not pass; then the tests rlhf_core passes that the baseline does not.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET

from summarize import outcome


def outcomes(path: str) -> dict[str, str]:
    """test id (``module.Class::name``) -> passed / failed / skipped."""
    return {f"{case.get('classname')}::{case.get('name')}": outcome(case)
            for case in ET.parse(path).getroot().iter("testcase")}


def main(baseline_path: str, ours_path: str, label: str = "baseline") -> None:
    baseline, ours = outcomes(baseline_path), outcomes(ours_path)
    passing = sorted(test for test, result in baseline.items() if result == "passed")
    kept = [test for test in passing if ours.get(test) == "passed"]
    lost = [test for test in passing if ours.get(test) != "passed"]
    gained = sorted(test for test, result in ours.items() if result == "passed" and baseline.get(test) != "passed")
    ratio = len(kept) / len(passing) if passing else float("nan")
    print(f"TRL 0.11.4 ({label}) passes {len(passing)} tests; rlhf_core passes {len(kept)} of them ({ratio:.1%})")
    for test in lost:
        print(f"  NOT PASSED by rlhf_core ({ours.get(test, 'absent')}): {test}")
    print(f"rlhf_core passes {len(gained)} tests that TRL 0.11.4 ({label}) does not")
    for test in gained:
        print(f"  only rlhf_core ({baseline.get(test, 'absent')} there): {test}")


if __name__ == "__main__":
    main(*sys.argv[1:4])
