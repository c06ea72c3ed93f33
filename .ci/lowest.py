"""Print pip constraints pinning every dependency pyproject.toml declares to its floor (`>=X` -> `==X`).

The floor pass of .ci/run installs with these: every declared floor at once, as the oldest
environment a user may resolve. A dependency whose floor is given as `>=X` in several places
(the main list, an extra) is pinned to the highest of them.
"""

import re
import sys
from pathlib import Path

import tomllib

project = tomllib.loads(Path(sys.argv[1] if len(sys.argv) > 1 else "pyproject.toml").read_text())["project"]
lists = [project["dependencies"], *project.get("optional-dependencies", {}).values()]
floors: dict[str, str] = {}
for spec in (s for deps in lists for s in deps):
    found = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)\s*>=\s*([0-9][0-9A-Za-z.]*)\s*(?:,.*)?", spec.split(";")[0])
    if found is None:
        continue  # an exact pin or a bare name has no floor to pin
    name, version = found[1].lower(), found[2]
    old = floors.get(name)
    if old is None or tuple(map(int, re.findall(r"\d+", version))) > tuple(map(int, re.findall(r"\d+", old))):
        floors[name] = version
for name, version in sorted(floors.items()):
    print(f"{name}=={version}")
