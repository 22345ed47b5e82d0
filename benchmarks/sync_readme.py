"""Copy the results of ``benchmarks/RESULTS.md`` into the README's Benchmarks section.

``python benchmarks/sync_readme.py`` replaces everything between the README's ``## Benchmarks`` introduction
(up to and including its first blank-line-separated paragraph) and the next ``## `` heading with the
``## Results`` part of ``RESULTS.md`` onwards, one heading level down and with image paths made relative to
the repository root. Run it after ``benchmarks/run.py`` and after editing the reading in ``RESULTS.md``.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def results_part(text: str) -> str:
    """The part of RESULTS.md from ``## Results`` on, without that heading, headings one level down."""
    start = text.index("## Results\n")
    body = text[start + len("## Results\n") :].strip("\n")
    body = re.sub(r"^(#{2,5}) ", lambda m: "#" + m.group(1) + " ", body, flags=re.M)
    return body.replace("](results/", "](benchmarks/results/")


def sync(readme: str, results: str) -> str:
    """The README with its Benchmarks section's results replaced by ``results_part(results)``."""
    head = readme.index("## Benchmarks\n")
    intro_end = readme.index("\n\n", readme.index("\n\n", head) + 2)  # the heading, then one paragraph
    section_end = readme.index("\n## ", intro_end)
    return readme[: intro_end + 2] + results_part(results) + "\n" + readme[section_end:]


def main() -> None:
    readme_path = ROOT / "README.md"
    new = sync(readme_path.read_text(), (ROOT / "benchmarks" / "RESULTS.md").read_text())
    readme_path.write_text(new)
    print(f"updated {readme_path.name}")


if __name__ == "__main__":
    main()
