"""Pass / fail / skip counts per TRL test file from a pytest JUnit XML report (and the failing test ids)."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict


def outcome(case: ET.Element) -> str:
    """passed, failed (failure or error) or skipped."""
    if case.find("skipped") is not None:
        return "skipped"
    if case.find("failure") is not None or case.find("error") is not None:
        return "failed"
    return "passed"


def main(path: str, label: str) -> None:
    per_file: dict[str, Counter] = defaultdict(Counter)
    failed: list[str] = []
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")[1] if "." in case.get("classname", "") else case.get("classname")
        result = outcome(case)
        per_file[module][result] += 1
        if result == "failed":
            failed.append(f"{case.get('classname')}::{case.get('name')}")
    total = Counter()
    print(f"TRL 0.11.4 tests against {label}:")
    for module in sorted(per_file):
        counts = per_file[module]
        total.update(counts)
        print(f"  {module:32s} passed {counts['passed']:4d}  failed {counts['failed']:4d}  skipped {counts['skipped']:4d}")
    print(f"  {'TOTAL':32s} passed {total['passed']:4d}  failed {total['failed']:4d}  skipped {total['skipped']:4d}")
    for test in failed:
        print(f"  FAILED {test}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "?")
